"""transfer.sgd: the fine-tuning loop's Polyak averaging, and what a trial's worker prints as it is stopped."""
from pathlib import Path

import pytest
import torch

from transfer.sgd import Polyak


def test_polyak_average_is_what_the_run_evaluates():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    avg = Polyak(model, 0.5)
    values = [1.0, 2.0, 3.0]
    expected = 0.0
    for n, v in enumerate(values):
        with torch.no_grad():
            model.weight.fill_(v)
        avg.update(model)
        d = min(0.5, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * v
    assert avg.model.weight.flatten().tolist() == pytest.approx([expected, expected])
    assert model.weight[0, 0].item() == 3.0  # the trained model itself is left alone


def _sigterm_in_a_finalizer() -> int:
    """In a Ray worker, what the raylet's SIGTERM does to a trial worker that is shutting down:
    Ray's handler raises SystemExit inside a weakref callback. Then a ValueError in one, which
    must still be reported. Returns the worker's pid."""
    import os
    import signal
    import sys
    import weakref

    class Thing:
        pass

    def on_collect_kill(_):
        os.kill(os.getpid(), signal.SIGTERM)  # Ray's handler runs at the next bytecode, in here

    def on_collect_fail(_):
        raise ValueError("a real fault in a finalizer")

    for callback in (on_collect_kill, on_collect_fail):
        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing
    del ref
    sys.stderr.flush()
    return os.getpid()


@pytest.mark.parametrize("mute", [False, True], ids=["ray's default", "start_trial"])
def test_a_sigterm_landing_in_a_finalizer_prints_no_traceback_from_a_trial(ray_session, mute):
    from ray._private import worker as ray_worker

    from transfer.sgd import start_trial

    def trial_worker(mute):
        if mute:
            start_trial(1, 0, 0)
        return _sigterm_in_a_finalizer()

    remote = ray_session.remote(max_calls=1)(trial_worker)
    pid = ray_session.get(remote.remote(mute))
    logs = Path(ray_worker._global_node.get_logs_dir_path())
    err = "".join(p.read_text() for p in logs.glob(f"worker-*-{pid}.err"))
    assert "ValueError: a real fault in a finalizer" in err  # other unraisable errors still show
    assert ("SystemExit" in err) is not mute
