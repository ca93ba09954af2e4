"""libgwtf from Python: train one model together on many machines.

A trainer starts a `Peer` (a member of the swarm), takes its tasks in a
loop and answers each one; the library does the rest (membership, routing,
transport, crash recovery, the gradient all-reduce, state transfer):

    with gwtf.Peer(role=gwtf.Role.RELAY, stage=None, swarm_key=KEY,
                   relay_stages=2, activation_bytes=[...], state_bytes=[...],
                   bootstrap=["10.0.0.1:7001"]) as peer:
        for task in peer.tasks():
            with task:            # an exception answers it as failed
                trainer.run(task)

`gwtf.torch_stage` holds a trainer for stages written as PyTorch modules.
"""
from .errors import (
    BufferTooSmall, Closed, CudaError, CudaUnavailable, GwtfError, Internal, InvalidArgument,
    IoError, LimitExceeded, NotFound, NullPointer, OutOfMemory, Panic, Poisoned, ProtocolError,
    Timeout, UnsupportedVersion,
)
from .peer import (
    DIGEST_LEN, Contact, Microbatch, OutFrame, Peer, Role, Task, TaskKind, node_key_id,
)

__all__ = [
    "BufferTooSmall", "Closed", "Contact", "CudaError", "CudaUnavailable", "DIGEST_LEN",
    "GwtfError", "Internal", "InvalidArgument", "IoError", "LimitExceeded", "Microbatch",
    "NotFound", "NullPointer", "OutFrame", "OutOfMemory", "Panic", "Peer", "Poisoned",
    "ProtocolError", "Role", "Task", "TaskKind", "Timeout", "UnsupportedVersion", "node_key_id",
]
__version__ = "0.1.0"
