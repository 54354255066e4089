"""Ray Train's torch process group without a listener on every interface, for one-machine runs.

``dist.init_process_group("env://")``, Ray Train's default, starts a TCPStore on rank 0 that
listens on every interface (torch has no bind address for it), and gloo binds its pairs to the
address the host name resolves to. When every worker runs on the loopback node that
:func:`training.ray_utils.init_ray` or ``infra/ray/local-cluster.sh`` starts, nothing outside
the machine needs to reach them: the rendezvous is then a FileStore (no socket at all) and
gloo and NCCL use the loopback interface. On a cluster the default applies, and its ports are
listed in the security documentation.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass

import ray
from ray.train.torch import TorchConfig
from ray.train.torch import config as _torch_config

LOOPBACK_ADDRESSES = frozenset({"127.0.0.1", "::1"})


def _node_address() -> str:
    return ray.util.get_node_ip_address()


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), "lo"))


def _use_loopback() -> None:
    interface = _loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    os.environ["NCCL_SOCKET_IFNAME"] = interface
    os.environ["MASTER_ADDR"] = "127.0.0.1"


class _LoopbackTorchBackend(_torch_config._TorchBackend):
    _rendezvous: str | None = None

    def on_start(self, worker_group, backend_config) -> None:
        addresses = set(worker_group.execute(_node_address))
        if len(worker_group) < 2 or not addresses <= LOOPBACK_ADDRESSES:
            return super().on_start(worker_group, backend_config)
        backend = backend_config.backend
        if backend is None:
            backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"
        # Private to this user; torch removes the store file when the last rank lets go of it.
        self._rendezvous = tempfile.mkdtemp(prefix="vitscale-rdzv-")
        worker_group.execute(_use_loopback)
        if not isinstance(worker_group, _torch_config.V1WorkerGroup):
            worker_group.execute(_torch_config._set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(
            i, _torch_config._setup_torch_process_group, backend=backend, world_rank=i,
            world_size=len(worker_group), init_method=f"file://{self._rendezvous}/store",
            timeout_s=backend_config.timeout_s) for i in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config) -> None:
        try:
            super().on_shutdown(worker_group, backend_config)
        finally:
            if self._rendezvous:
                shutil.rmtree(self._rendezvous, ignore_errors=True)


@dataclass
class LoopbackTorchConfig(TorchConfig):
    """``TorchConfig`` whose process group stays on loopback when all workers run on the loopback node."""

    @property
    def backend_cls(self):
        return _LoopbackTorchBackend
