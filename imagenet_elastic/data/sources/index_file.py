"""The index files (.npz) sources keep of their samples: the file-list cache of a folder, the index of tar shards (a
cache in the checkpoints folder, or the one `pack` wrote beside its shards). Whatever numpy raises for a damaged,
cut-short or empty file becomes `Unreadable`, naming it: a cache is then rebuilt with a warning, a pack's own index
refused in one line; an absent file or another version is rebuilt silently.
"""

from __future__ import annotations

import io
import os
import zipfile
from typing import Optional

import numpy as np

from imagenet_elastic.atomic_files import atomic_write_bytes
from imagenet_elastic.errors import first_line


class Unreadable(Exception):
    """An index file numpy cannot read; the message names it and says why."""


def write(path: str, version: int, **arrays: np.ndarray) -> None:
    """The arrays and `version` as one .npz, written atomically."""
    buffer = io.BytesIO()
    np.savez(buffer, version=np.int64(version), **arrays)
    atomic_write_bytes(buffer.getvalue(), path)


def read(path: str, version: int, names: tuple[str, ...],
         optional: tuple[str, ...] = ()) -> Optional[dict[str, np.ndarray]]:
    """The arrays `names` of the index file at `path`, all read now, and those of `optional` it holds (a file from
    before them reads as it is); None when absent or of another version; `Unreadable` when not a whole .npz."""
    if not os.path.isfile(path):
        return None
    try:
        saved = np.load(path, allow_pickle=False)
    except EOFError:
        raise Unreadable(f"{path} is empty") from None
    except zipfile.BadZipFile as error:  # cut short, or overwritten in part
        raise Unreadable(f"{path} is damaged ({first_line(error)[:200]})") from None
    except OSError as error:
        raise Unreadable(f"{path} cannot be read ({error.strerror or error})") from None
    except ValueError:  # neither a zip nor an array file: numpy took it for a pickle, which it refuses
        raise Unreadable(f"{path} is not a numpy .npz file") from None
    if not isinstance(saved, np.lib.npyio.NpzFile):
        raise Unreadable(f"{path} is not a numpy .npz file")
    with saved:
        try:
            if int(saved["version"]) != version:
                return None
            return {name: saved[name] for name in (*names, *(n for n in optional if n in saved.files))}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:  # a member cut short or missing
            why = error.args[0] if isinstance(error, KeyError) and error.args else first_line(error)
            raise Unreadable(f"{path} is damaged ({str(why)[:200]})") from None
