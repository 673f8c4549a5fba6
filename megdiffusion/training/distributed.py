"""Running one training function on one device or on several through ``megengine.distributed``.

Single process: ``launch`` calls the worker directly with world size 1, rank 0. More GPUs (or a
multi-machine ``--world_size``): one process per local GPU through ``megengine.distributed.launcher``;
each asks ``rank_and_world()`` who it is. Distributed MegEngine needs GPUs.

The workers are started with the "spawn" method: the parent has already created tensors (config
checks, the CUDA probe), and a CUDA context does not survive ``fork``.
"""
import multiprocessing

from megdiffusion.compat import cuda_available, quiet_megengine
from megdiffusion.errors import MegdiffusionError


class LaunchError(MegdiffusionError):
    """Distributed settings this machine cannot run; the message is one line."""


def is_multiprocess(cfg):
    """Whether the config asks for more than one training process."""
    return cfg.num_gpus > 1 or cfg.total_world_size > 1


def check_launch(cfg):
    """Fail early, in one line, when the device or distributed flags cannot work here."""
    if is_multiprocess(cfg) and cfg.device == "cpu":
        raise LaunchError("distributed training runs on GPUs only; drop --device cpu or use --num_gpus 1")
    wants_gpu = cfg.device == "gpu" or is_multiprocess(cfg)
    if wants_gpu and not cuda_available():
        what = f"--num_gpus {cfg.num_gpus}" if is_multiprocess(cfg) else "--device gpu"
        raise LaunchError(f"{what} needs CUDA GPUs, but MegEngine sees none on this machine; "
                          "use --num_gpus 1 --device cpu")
    if cfg.rank_start > 0 and cfg.port == 0:
        raise LaunchError("--rank_start > 0 (a machine other than the master) needs the master's --port")


def launch(worker, cfg, *args, use_launcher=None):
    """Run ``worker(cfg, *args)`` once here, or once per local GPU through MegEngine's launcher.

    ``use_launcher``: None = only for more than one process; True also launches a single GPU process.
    """
    if not (is_multiprocess(cfg) if use_launcher is None else use_launcher):
        return worker(cfg, *args)
    dist = quiet_megengine().distributed
    multiprocessing.set_start_method("spawn", force=True)
    return dist.launcher(worker, n_gpus=cfg.num_gpus, world_size=cfg.total_world_size,
                         rank_start=cfg.rank_start, master_ip=cfg.master_ip, port=cfg.port)(cfg, *args)


def rank_and_world():
    """``(rank, world_size)`` of this process; ``(0, 1)`` outside a distributed group."""
    dist = quiet_megengine().distributed
    if dist.is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast_from_rank0(module):
    """Make every rank's parameters and buffers equal to rank 0's."""
    dist = quiet_megengine().distributed
    dist.bcast_list_(list(module.parameters()) + list(module.buffers()))


def allreduce_mean_callbacks(world_size):
    """GradManager callbacks that average gradients over ranks (none for a single process)."""
    if world_size == 1:
        return []
    return [quiet_megengine().distributed.make_allreduce_cb("mean")]


def select_device(cfg):
    """Pin MegEngine to the CPU for ``--device cpu``; otherwise keep its default (a GPU when present)."""
    if cfg.device == "cpu":
        quiet_megengine().set_default_device("cpux")
