"""Content hashes of full KV blocks, chained so a hash names a whole prefix.

    block 0                 block 1                 block 2
    [t0 .. t15]             [t16 .. t31]            [t32 .. t47]
    h0 = H(salt, t0..t15)   h1 = H(h0, t16..t31)    h2 = H(h1, t32..t47)

Equal hashes mean equal token prefixes (SHA-256, so collisions are not a practical concern). The cache
salt enters the first block's hash and, through the chain, every later one: two requests with different
salts share no block. Only full blocks are hashed; a partial last block has no hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

# Marks the start of a chain so that no token bytes can imitate a parent digest.
_ROOT = b"sluice-kv-root"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None) -> BlockHash:
    """Hash one full block: its parent's hash, its token ids and (for the first block) the salt."""
    digest = hashlib.sha256()
    if parent is None:
        digest.update(_ROOT)
        # Length-prefix the salt so "" and None differ and the salt cannot bleed into the tokens.
        salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode()
        digest.update(len(salt).to_bytes(4, "little") + salt)
    else:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    start: int = 0,
) -> None:
    """Append to `hashes` the hash of every full block not hashed yet (in place), `token_ids` being the
    sequence's tokens from position `start` on (a block boundary, at or before the first block not
    hashed yet)."""
    if start % block_size or start > len(hashes) * block_size:
        raise ValueError(f"start: {start} is not a block boundary at or before the unhashed blocks")
    num_full_blocks = (start + len(token_ids)) // block_size
    for i in range(len(hashes), num_full_blocks):
        parent = hashes[i - 1] if i > 0 else None
        at = i * block_size - start
        hashes.append(hash_block(parent, token_ids[at : at + block_size], cache_salt))
