"""``cuda_ipc``: buckets in the trainer rank's GPU memory, handed to the server by handle.

Trainer ranks and servers on one host (one GPU, or several GPUs of a node). Each trainer
rank packs its buckets into slots on its own GPU and names each slot in a
``/update_weights_from_tensor`` request as a CUDA IPC handle (torch's CUDA tensor sharing,
as SGLang's own weight updates do); the server's rank opens the handle (once: torch caches
opened handles per process), verifies and scatters on the GPU, and synchronizes before its
reply, so the trainer rank may refill the slot once the request returns. No byte goes
through host memory. NCCL cannot do this on one GPU (it refuses two ranks on one device).
A handle names its GPU by index: every process of a node sees the same numbering (the
launcher sets no ``CUDA_VISIBLE_DEVICES``).

The same code runs on CPU tensors, shared through torch's ``file_system`` strategy (the
payload's pickling), which is how CPU tests cover everything but the handle itself; the
config admits it only between CUDA ends (``cuda``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.ddma.staged import StagedTransport

if TYPE_CHECKING:
    import torch


class DeviceSlots:
    """``count`` bucket-sized slots in one allocation on ``device``, kept across versions."""

    may_be_gone = False  # every request carries its handle anew

    def __init__(self, bucket_bytes: int, count: int, device: str) -> None:
        import torch

        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else device
        self.data = torch.empty(count, bucket_bytes, dtype=torch.uint8, device=dev)
        # Host memory (CPU tests) is moved into shared memory here, not when the first
        # request pickles a slot: that move copies the whole allocation while the next
        # round is being packed into it, and loses whatever the packing wrote meanwhile.
        if not self.data.is_cuda:
            self.data.share_memory_()
        self.nbytes = self.data.numel()

    def slot(self, i: int) -> torch.Tensor:
        return self.data[i]

    def entry(self, i: int, nbytes: int) -> tuple[dict[str, object], torch.Tensor]:
        import torch

        if self.data.is_cuda:  # the server's stream must see the packed bytes
            torch.cuda.current_stream(self.data.device).synchronize()
        return {"shared": True}, self.data[i][:nbytes]

    def posted(self) -> None:
        pass


class CudaIpc(StagedTransport):
    name = "cuda_ipc"
    summary = "GPU buckets handed to the servers as CUDA IPC handles; one host, CUDA only"
    one_host = True
    cuda = True

    def slots(self, bucket_bytes: int, count: int, device: str) -> DeviceSlots:
        return DeviceSlots(bucket_bytes, count, device)

    def locate(self, ctl: dict, tensor: torch.Tensor, bucket_bytes: int) -> torch.Tensor:
        if not ctl.get("shared"):
            raise ValueError("a cuda_ipc entry carries its bucket as the entry's tensor")
        return tensor.reshape(-1)

    def release(self, msg: torch.Tensor) -> None:
        import torch

        if msg.is_cuda:  # the scatter has read every byte before the reply goes back
            torch.cuda.current_stream(msg.device).synchronize()


TRANSPORT = CudaIpc()
