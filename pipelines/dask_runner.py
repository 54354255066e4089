"""Beam 2.77 on a ``dask.distributed`` cluster: the runner the ingest uses, and the clusters it starts.

Every workaround for Beam's ``DaskRunner`` lives here; ``tests/pipelines/test_dask.py`` shows
each behaviour, and ``docs/scale-out.md`` what it costs in memory.

- **Tagged outputs** reach every consumer: the DaskRunner hands a ``ParDo``'s whole output bag
  to ``with_outputs``, ``with_exception_handling`` and ``Partition`` consumers alike. Not worked
  around: the ingest uses no tagged outputs (:mod:`pipelines.graph`), and ``--runner dask``
  refuses ``--isolate-decoder``, which needs them.
- **Side inputs are computed again** inside each consumer's task, and can come out wrong.
  :class:`DaskRunner` makes each one an ordinary dependency, computed once on the cluster.
- **A task keeps its outputs** (in its receivers, a task argument) until a shuffle has every
  partition, and **drops what ``finish_bundle`` emits**. :func:`_apply_dofn` fixes both.
- **Combines are not lifted**: every ``CombinePerKey`` shuffles one element per input.
  :func:`overrides` lifts each one without side inputs into Beam's ``LiftedCombinePerKey``.
- **Freed memory is kept** inside glibc's heap; :func:`give_back_freed_memory` returns it.
- **Only the last step runs**, so the ingest's last step collects every output.
- **The client is never closed**; :class:`DaskRunner`'s result closes it.
- **Metrics** raise ``NotImplementedError``; the ingest counts from its outputs on every runner.

:func:`local_cluster` starts a ``LocalCluster`` on 127.0.0.1 for ``--runner dask`` without an
address; :func:`connect` checks a ``--dask-address`` before the pipeline is built.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from typing import Iterator

from apache_beam import pvalue
from apache_beam.pipeline import PTransformOverride
from apache_beam.runners.dask import dask_runner as _beam_dask
from apache_beam.runners.dask import transform_evaluator as _te
from apache_beam.runners.runner import PipelineState
from apache_beam.transforms.sideinputs import SideInputMap

from pipelines.glibc import malloc_trim

log = logging.getLogger(__name__)

#: What ``--runner`` Beam is given for ``--runner dask``.
RUNNER = f"{__name__}.DaskRunner"
#: Seconds to wait for a scheduler named by ``--dask-address`` before giving up.
CONNECT_TIMEOUT_S = 10


class DaskUnavailable(RuntimeError):
    """No scheduler at the address, or the package is missing: a usage error for the job."""


def require_distributed():
    """``distributed``, or DaskUnavailable naming the extra to install."""
    try:
        import distributed
    except ImportError:
        raise DaskUnavailable(
            "--runner dask needs dask.distributed; install the extra: pip install -c constraints.txt '.[dask]'"
        ) from None
    # The client and a local cluster log each connection and worker at INFO; a job's terminal wants warnings.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    return distributed


# -- side inputs as graph dependencies -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _SideSpec:
    view_class: type
    view_options: dict
    window_fn: object


#: Seconds between two :func:`give_back_freed_memory` calls that do the work, in one worker process.
TRIM_INTERVAL_S = 1.0
_last_trim = [0.0]


def give_back_freed_memory(interval: float = TRIM_INTERVAL_S) -> bool:
    """Return the pages glibc keeps free inside its heaps to the system, at most once per ``interval`` s.

    A worker decodes images between long-lived small objects (records waiting for a shuffle,
    its own task state), so what each bundle frees stays in the heap as free chunks it cannot
    shrink past. Returns whether it ran (:func:`pipelines.glibc.malloc_trim`).
    """
    now = time.monotonic()
    if now - _last_trim[0] < interval:
        return False
    _last_trim[0] = now
    return malloc_trim()


def _apply_dofn(items, invoker_args, invoker_kwargs, receivers):
    """Beam's ``apply_dofn_to_bundle``, with what ``finish_bundle`` emits, then its receivers emptied.

    Beam 2.77 takes the bundle's outputs before it calls ``finish_bundle``, so that method's
    outputs were lost; here they are taken after it.

    The receivers are an argument of the task, so the worker keeps them with the task's spec
    until the task's result is released, and Beam leaves every output of the bundle in them:
    a task whose result waits for a shuffle (every ``GroupByKey`` and combine) kept all it
    emitted, decoded images included, until the shuffle had every partition.
    """
    try:
        invoker = _te.DoFnInvoker.create_invoker(*invoker_args, **invoker_kwargs)
        invoker.invoke_setup()
        invoker.invoke_start_bundle()
        for item in items:
            invoker.invoke_process(item)
        invoker.invoke_finish_bundle()
        results = [v.value for v in receivers.values]
        invoker.invoke_teardown()
        return results
    finally:
        receivers.values.clear()
        give_back_freed_memory()


def _apply_dofn_with_side_inputs(items, invoker_args, invoker_kwargs, receivers, specs, *side_values):
    """:func:`_apply_dofn` with the side inputs' computed values rebuilt into SideInputMaps."""
    maps = [
        SideInputMap(spec.view_class, spec.view_options,
                     [_te.get_windowed_value(v, spec.window_fn) for v in values])
        for spec, values in zip(specs, side_values)
    ]
    return _apply_dofn(items, invoker_args, dict(invoker_kwargs, side_inputs=maps), receivers)


def _concat(partitions) -> list:
    return [x for part in partitions for x in part]


def _window_fn(op: _te.ParDo):
    main_input = next(iter(op.applied.main_inputs.values()))
    return main_input.windowing.windowfn if hasattr(main_input, "windowing") else None


class _Capture:
    """Stands in for the input bag to read the ``map_partitions`` arguments Beam's ParDo.apply builds."""

    args: tuple = ()

    def map(self, *args, **kwargs):
        return self

    def map_partitions(self, func, *args, **kwargs):
        self.args = args
        return self


def _invoker_arguments(op: _te.ParDo) -> tuple:
    """(invoker args, invoker kwargs, receivers) exactly as Beam 2.77's ParDo.apply builds them."""
    capture = _Capture()
    _te.ParDo.apply(op, capture, None)
    return capture.args


_TRANSLATIONS = dict(_te.TRANSLATIONS)


class _ParDo(_te.ParDo):
    """Beam's Dask ParDo, but side inputs are computed once, as dependencies of this step's tasks,
    and a finished task keeps none of its outputs (:func:`_apply_dofn`)."""

    def apply(self, input_bag, side_inputs=None):
        invoker_args, invoker_kwargs, receivers = _invoker_arguments(self)
        if not side_inputs:
            return input_bag.map(_te.get_windowed_value, _window_fn(self)).map_partitions(
                _apply_dofn, invoker_args, invoker_kwargs, receivers,
            )
        import dask

        specs, values = [], []
        for sim in side_inputs:
            it = sim._iterable  # Beam's DaskBagWindowedIterator: the producer's bag and window fn
            specs.append(_SideSpec(sim._view_class, sim._view_options, it.window_fn))
            # Partition by partition under the bag's own keys: a bag handed to dask.delayed whole is
            # optimised on its own first, into fused copies of every step before it, which run again.
            values.append(dask.delayed(_concat)(it.bag.to_delayed(optimize_graph=False)))
        return input_bag.map(_te.get_windowed_value, _window_fn(self)).map_partitions(
            _apply_dofn_with_side_inputs, invoker_args, invoker_kwargs, receivers, specs, *values,
        )


_TRANSLATIONS[_te.apache_beam.ParDo] = _ParDo


# -- combiner lifting ------------------------------------------------------------------------------

class _LiftCombinePerKey(PTransformOverride):
    """``CombinePerKey`` without side inputs -> Beam's ``LiftedCombinePerKey`` (partial combines per bundle).

    ``CombineGlobally``, ``Count``, ``Distinct``, ``ToList`` and the other combiners expand into a
    ``CombinePerKey``, so all of them are lifted. A combine with side inputs is already a
    ``LiftedCombinePerKey`` (Beam builds one for it) and does not match.
    """

    def matches(self, applied_ptransform) -> bool:
        import apache_beam as beam

        return type(applied_ptransform.transform) is beam.CombinePerKey

    def get_replacement_transform_for_applied_ptransform(self, applied_ptransform):
        from apache_beam.transforms.combiners import LiftedCombinePerKey, curry_combine_fn

        transform = applied_ptransform.transform
        return LiftedCombinePerKey(curry_combine_fn(transform.fn, transform.args, transform.kwargs), (), {})


def overrides() -> list:
    """Every transform replacement the Dask runner makes, in the order Beam must apply them.

    The lifting comes first: its replacement holds a ``GroupByKey``, which Beam's own Dask
    overrides then replace.
    """
    from apache_beam.runners.dask.overrides import dask_overrides

    return [_LiftCombinePerKey(), *dask_overrides()]


def _bag_visitor(bag_kwargs: dict):
    """Beam 2.77's ``DaskRunner.to_dask_bag_visitor`` with this module's ParDo translation."""
    from apache_beam.pipeline import PipelineVisitor

    class Visitor(PipelineVisitor):
        def __init__(self):
            self.bags = collections.OrderedDict()

        def visit_transform(self, node) -> None:
            op = _TRANSLATIONS.get(node.transform.__class__, _te.NoOp)(node, bag_kwargs=bag_kwargs)
            kws = {"input_bag": None, "side_inputs": None}
            inputs = list(node.inputs)
            if inputs:
                bags = []
                for value in inputs:
                    if isinstance(value, pvalue.PBegin):
                        bags.append(None)
                    if value.producer in self.bags:
                        bags.append(self.bags[value.producer])
                kws["input_bag"] = bags[0] if len(bags) == 1 and not isinstance(op, _te.Flatten) else bags
            if node.side_inputs:
                kws["side_inputs"] = [
                    SideInputMap(type(si), si._view_options(),
                                 _te.DaskBagWindowedIterator(self.bags.get(si.pvalue.producer), si._window_mapping_fn))
                    for si in node.side_inputs
                ]
            self.bags[node] = op.apply(**kws)

    return Visitor()


# -- the runner ----------------------------------------------------------------------------------

class _Result(_beam_dask.DaskRunnerResult):
    def wait_until_finish(self, duration=None):
        try:
            return super().wait_until_finish(duration)
        finally:
            if duration is None or self.state in (PipelineState.DONE, PipelineState.FAILED):
                self.client.close()


class DaskRunner(_beam_dask.DaskRunner):
    """Beam 2.77's DaskRunner: side inputs computed once on the cluster, combines lifted, the client closed after."""

    def run_pipeline(self, pipeline, options):
        import dask

        distributed = require_distributed()
        dask_options = options.view_as(_beam_dask.DaskOptions).get_all_options(drop_default=True, current_only=True)
        bag_kwargs = _beam_dask.DaskOptions._extract_bag_kwargs(dask_options)
        client = distributed.Client(**dask_options)
        try:
            pipeline.replace_all(overrides())
            visitor = _bag_visitor(bag_kwargs)
            pipeline.visit(visitor)
            # As in Beam: the last bag is the pipeline's sink, and its graph reaches every step before it.
            graph = dask.optimize(list(visitor.bags.values())[-1])
            return _Result(client, client.compute(graph))
        except BaseException:  # a graph that cannot be translated or submitted: _Result never owns the client
            client.close()
            raise


# -- clusters ------------------------------------------------------------------------------------

def connect(address: str, timeout: float = CONNECT_TIMEOUT_S) -> int:
    """Check that a scheduler answers at ``address``; returns its number of workers (it may be 0)."""
    distributed = require_distributed()
    try:
        with distributed.Client(address, timeout=timeout, set_as_default=False) as client:
            return len(client.scheduler_info(n_workers=-1)["workers"])
    except (OSError, TimeoutError, ValueError) as exc:
        raise DaskUnavailable(
            f"--dask-address {address}: no Dask scheduler answered in {timeout:g} s ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); start one (dask-scheduler) or fix the address"
        ) from None


@contextlib.contextmanager
def local_cluster(workers: int) -> Iterator[str]:
    """A LocalCluster of ``workers`` single-threaded processes on 127.0.0.1; yields the scheduler's address."""
    distributed = require_distributed()

    # Single-threaded worker processes: the decode path holds the GIL for much of its time, and one
    # process per core is what the DirectRunner's --workers means too. Everything on loopback:
    # Dask's scheduler and workers take any client that reaches them, with no authentication.
    # No dashboard; the scheduler's HTTP server (health, metrics) still starts, on a free loopback port.
    cluster = distributed.LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1", protocol="tcp",
        dashboard_address=None, scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
        silence_logs=logging.WARNING,
    )
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()
