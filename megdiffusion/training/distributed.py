"""Running one function (training, sampling) on one device or on several through ``megengine.distributed``.

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


def is_multiprocess(num_gpus, world_size=None):
    """Whether the settings ask for more than one process (``world_size`` None: ``num_gpus``)."""
    return num_gpus > 1 or (world_size or num_gpus) > 1


def check_launch(num_gpus, device="auto", world_size=None, rank_start=0, port=0):
    """Fail early, in one line, when the device or distributed flags cannot work here."""
    multiprocess = is_multiprocess(num_gpus, world_size)
    # what asks for several processes, and the change that makes it one
    several, one = ((f"--num_gpus {num_gpus}", "--num_gpus 1") if num_gpus > 1 else
                    (f"--world_size {world_size}", "--world_size 1 (or no --world_size)"))
    if multiprocess and device == "cpu":
        raise LaunchError(f"distributed runs ({several}) use GPUs only; drop --device cpu, or use {one}")
    if (device == "gpu" or multiprocess) and not cuda_available():
        raise LaunchError(f"{several if multiprocess else '--device gpu'} needs CUDA GPUs, but MegEngine sees none "
                          f"on this machine; use {one if multiprocess else '--device cpu'}")
    if rank_start > 0 and port == 0:
        raise LaunchError("--rank_start > 0 (a machine other than the master) needs the master's --port")


def launch(worker, args, num_gpus=1, world_size=None, rank_start=0, master_ip="localhost", port=0,
           use_launcher=None):
    """Run ``worker(*args)`` here, or once per local GPU in spawned processes through MegEngine's launcher.

    Launched: returns the list of the local processes' results; ``worker`` and ``args`` must pickle, and
    each process asks ``rank_and_world()`` who it is. ``use_launcher``: None = only for more than one
    process; True launches a single GPU process too.
    """
    if not (is_multiprocess(num_gpus, world_size) if use_launcher is None else use_launcher):
        return worker(*args)
    dist = quiet_megengine().distributed
    multiprocessing.set_start_method("spawn", force=True)
    return dist.launcher(worker, n_gpus=num_gpus, world_size=world_size or num_gpus, rank_start=rank_start,
                         master_ip=master_ip, port=port)(*args)


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
