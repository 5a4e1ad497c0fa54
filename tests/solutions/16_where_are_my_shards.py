"""Exercise 16: read a DCP checkpoint's .metadata: where does each piece of a tensor lie?

Lesson 16's dcp.save writes one file per rank and a .metadata index. To load at another
world size, each new rank asks the index which pieces of each tensor it needs and in which
file (and at which byte offset) they lie: that is what resharding is. Read the index yourself.

Your task: shards_of(folder, key) returns one (file, offsets, sizes) per saved piece of the
tensor `key`, sorted by offsets: the file name (e.g. "__1_0.distcp"), where the piece starts
in the whole tensor (a tuple, one number per dimension), and its shape (a tuple).
Hint: FileSystemReader(folder).read_metadata(); metadata.state_dict_metadata[key].chunks
(each has .offsets and .sizes); metadata.storage_data maps MetadataIndex(key, offsets) to
where the bytes are (.relative_path). Lesson 16, Step 6, and lessons/16_distributed_checkpoint/checkpointing.py.

Check it:  make check-16   (3 gloo ranks save an FSDP2-sharded model with dcp.save; your
                            answer must match the pieces each rank wrote, tensor by tensor)
"""
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex


def shards_of(folder: Path, key: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """[(file, offsets, sizes)] of every saved piece of tensor `key`, sorted by offsets."""
    metadata = FileSystemReader(folder).read_metadata()
    pieces = []
    for chunk in metadata.state_dict_metadata[key].chunks:
        where = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
        pieces.append((where.relative_path, tuple(chunk.offsets), tuple(chunk.sizes)))
    return sorted(pieces, key=lambda piece: piece[1])
