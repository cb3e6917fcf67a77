"""DDP checkpoints on a shared directory (rank 0 writes, atomically)."""
import os

import torch



# ------------------------------------------------------------ checkpoints

def _checkpoint_path(name, directory):
    d = directory or os.environ.get("MEMBOX_CHECKPOINT_DIR", "")
    if not d:
        raise RuntimeError(
            "no checkpoint directory: start the job with `membox launch "
            "--checkpoint-dir DIR` (MEMBOX_CHECKPOINT_DIR) or pass directory=")
    if not name or os.sep in name or name in (".", ".."):
        raise ValueError(f"checkpoint name must be a plain file name, not "
                         f"{name!r}")
    return os.path.join(d, name)


def save_checkpoint(state, name="ddp.pt", directory=None):
    """Saves a DDP job's own state -- with the hook, the memory nodes hold
    only gradients in flight, so the weights, the optimizer's state and the
    epoch or step are the workers' to keep. Rank 0 writes `state` (anything
    torch.save takes) to `name` in the job's checkpoint directory
    (`membox launch --checkpoint-dir`) atomically: a temporary file, fsync,
    rename, fsync of the directory, so a crash leaves the previous
    checkpoint whole. Every rank calls it; when a process group is up, the
    others wait until rank 0 has written (no rank runs ahead of it).
    Returns the path."""
    import torch.distributed as dist
    path = _checkpoint_path(name, directory)
    group = dist.is_available() and dist.is_initialized()
    if not group or dist.get_rank() == 0:
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if group:
        dist.barrier()
    return path


def load_checkpoint(name="ddp.pt", directory=None, map_location="cpu"):
    """The state last saved by save_checkpoint when this job was started to
    resume (`membox launch --resume`, MEMBOX_RESUMED=1) and the file
    exists; None for a fresh start. A resumed job whose checkpoint is
    missing gets None too (nothing was saved before it stopped). Every rank
    loads the same file: load it before training, then DDP's own first
    broadcast agrees with it anyway."""
    if os.environ.get("MEMBOX_RESUMED") != "1" and directory is None:
        return None
    path = _checkpoint_path(name, directory)
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location=map_location)
