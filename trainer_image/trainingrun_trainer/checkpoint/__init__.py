"""The trainer's checkpoint store: torch.distributed.checkpoint (DCP) on gs://, s3:// or file://.

Layout of one checkpoint, ``<uri>/step-<step, 8 digits>/``::

    .metadata              DCP's global metadata (rank 0)
    __<rank>_<n>.distcp    DCP data files, written by every rank (replicated tensors are
                           de-duplicated by DCP's planner, so a DDP model is written once);
                           each rank's ``extra`` dict is its entry ``extra-rank-<r>`` there
    __0_replicated.distcp  a sharded state on more than two pods: rank 0's replicated items (`mirroring`)
    manifest.json          the commit marker, written LAST by rank 0

Beside the step directories, ``<uri>/starts.json`` counts the run's process starts (written by rank 0 at each start
when ``checkpoint.interval.steps`` is ``auto``: its failure rate; `CheckpointStore.record_start`).

Format 1 (still read) kept each rank's ``extra`` in a file of its own, ``extra-rank-<r>.pt``.

``manifest.json`` = ``{format_version, step, time, world_size, config_hash, model_digest,
torch_version, run_uid, files: [{path, size, xxh3_128}]}`` listing every other file of the directory, each with its
xxh3_128 (format 4; formats 1-3 recorded a sha256 instead, and some format 3 manifests also carry an ``xxh3_128``
that readers ignore there).
A checkpoint without a valid manifest does not exist: readers skip directories with no manifest
(a save that never finished) and directories whose files are missing or do not match the
manifest's sizes / digests (corruption), and fall back to older ones.

Every scheme goes through fsspec and DCP's ``FsspecWriter`` / ``FsspecReader``, file:// (or a
plain path) included: one code path, so the fast file:// tests exercise the same code that
writes to buckets. ``gs://`` uses gcsfs defaults (Application Default Credentials,
``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST``); ``s3://`` uses s3fs defaults
(``AWS_*`` variables) and honours ``endpoint_url`` (config ``checkpoint.endpointUrl``) or
``AWS_ENDPOINT_URL``. ``storage_options`` passes anything else to the fsspec filesystem.

How a save is sequenced (same on every rank; collectives use a dedicated gloo group):

1. ``save()`` (training thread) first finishes the previous save, then stages: DCP's
   ``StateDictStager`` copies every tensor of ``state`` into CPU buffers that every save reuses (a real copy,
   also for CPU tensors; pinned with CUDA), and ``extra`` is serialized to
   bytes (this rank's entry of the state). Then it returns; the training loop may change its tensors at once,
   except those of the entries named in ``copy_in_background``: the background thread copies them first, and
   the loop calls ``wait_copied()`` before it changes them (the trainer: before the next optimizer step).
2. A single background thread (reused across saves, so fsspec/gcsfs sessions are reused) runs
   ``dcp.save``: rank 0 clears a stale directory of the same step while planning (before any
   rank writes), every rank writes its data files, rank 0 writes ``.metadata`` after DCP has
   gathered every rank's write results. Sizes and xxh3_128 are computed while the bytes stream
   out, so nothing is read back.
3. All ranks exchange (ok/error, file hashes).
4. Only if every rank succeeded, rank 0 writes ``manifest.json`` (file://: temp file, fsync,
   rename; object stores: one PUT, which is atomic) and broadcasts the outcome, so every rank's
   ``wait()`` returns the same :class:`CheckpointInfo` (or ``None``).
5. Rank 0 rotates (`rotation.Rotation`).

Persisting behind (``CheckpointStore(persist_behind=True)``, the trainer's default: ``checkpoint.persistBehind``), when
every rank shares one node's memory tier: in step 2 every rank writes its files straight into the tier's step
directory (`tier_files.RecycledFile`: into the mapped pages of the files of a step the tier no longer needs, with the
xxh3_128 of each 4 MiB segment beside them), and in step 4 rank 0 writes the manifest there: the checkpoint is
committed in memory and ``wait()`` returns it. Rank 0's persister thread then copies those files to storage unchanged,
and the same manifest bytes last (the commit in storage), and rotates storage. It copies the newest first: a memory
checkpoint committed while an older one is being copied replaces any still waiting (counted in
``metrics.superseded_persists``, logged); the tier keeps the newest and the one being copied, and the step before them as the
spare. ``flush()`` (and ``close()``) waits until storage holds the newest. A restart inside the pod resumes from the
tier's newest memory checkpoint when storage holds none as new; one whose copy turns out damaged is dropped, so the
next restart takes storage's newest. A save the tier lacks room for (on any rank) commits to storage as above.
While every rank's state keeps the layout of its last plan (agreed with one small all_reduce before staging), a save
to the tier skips ``dcp.save`` (`save_planner`) and each rank stages into its file only the tensors its last plan
writes: DCP's plan writes each replicated tensor from one rank, so the tier (and storage) holds one copy of a DDP
model and its moments, not one per rank. Such a save cannot fall back to storage, where DCP plans afresh and may ask
any rank for any tensor: a rank that finds no room to stage after all fails that save alone (the next one commits).
Several nodes: each node's lowest rank also writes the other nodes' ranks' files into its tier (`mirroring`: from its
own replica for DDP; for a sharded state, received from the pod that wrote them, in a ring), so every node holds every
file, the save commits in memory once each has them (the gathered statuses), and a replacement pod receives them from
a survivor (`peers`). A sharded state on more than two pods leaves each node with its own and its neighbour's files:
those saves commit in memory all the same, and persisting is spread over the pods (`persisting`: each pod's lead
copies its own ranks' files, rank 0 writes the manifest once every part is there). Rank 0 writes the replicated
items apart, ``__0_replicated.distcp``, which every node keeps, so a restart in place reads only its own node's
memory (`restoring.files_a_rank_reads`).

A storage error in steps 2-4 never raises into the training loop: each rank logs it once
(logger ``trainingrun.checkpoint``), counts it in ``metrics.failed_saves``, no manifest is written, and
the next save starts from scratch. Errors while staging (a caller bug such as an unpicklable
``extra``) do raise.

Trust model: whoever may write the bucket prefix may rewrite any file and fix the manifest up to match (sizes and
digests are no secret), so nothing read from storage can run code, name a path, or make a load unbounded:

- ``extra`` and DCP's other non-tensor values load with ``torch.load(weights_only=True)`` (tensors, numbers, strings,
  lists, tuples, dicts, numpy arrays); keep ``extra`` to such plain values.
- DCP's ``.metadata`` loads with an unpickler that admits exact (module, name) pairs only (DCP's metadata classes,
  torch dtypes and sizes; no dotted names, no imports) and keeps its memo in a dict; the result is then checked:
  every stored item must lie inside a file the verified manifest lists by plain name, within its size, and entry
  paths must be short. DCP's fallback to rank-local ``__<rank>.metadata`` is refused.
- A manifest lists plain names only (no separators, no ``..``), each once, with ASCII fields of the right types;
  step directories are ``step-`` and ASCII digits, matched whole.
- On file://, links are never listed as step directories or files, and deletes never follow one.

Anything else fails the load with CheckpointLoadError (the trainer exits "checkpoint refused"), or makes the
checkpoint invalid, and resume falls back to an older one. The digests in the manifest detect corruption, not
tampering (which is why a fast digest does as well as sha256 did).

The modules, by what they hold (each opens with what it is for):

- the format: `layout` (names, format version, digests, which files a rank reads), `records` (`CheckpointInfo`,
  `PendingSave` and what the stages pass along), `errors`, `manifest` (inspect, verify), `digest` (model digest),
  `tensor_files` (format 3's data files), `safe_load` (loading without running code), `export`, `listing`;
- storage: `storage` (fsspec), `hashing_fs` and `writer` (DCP's writer, hashing each file), `save_planner`;
- node memory: `memory_tier` (the newest commit kept in /dev/shm), `tier_files`, `tier_staging` (stage once);
- several pods: `pods` (`PodHooks`: what a save does because the run has several pods, at the three points of the
  commit where it acts -- before staging, after writing, after the commit -- and nothing on one pod), `ranks` (the
  store's collectives), `mirroring` (each pod keeps the others' files), `peers` (a new pod receives them), `transfer`
  (moves the files);
- the stages on top: `store` (`CheckpointStore`) composes `saving.Saver` (1), `committing.Committer` (2-5),
  `persisting.Persister`, `restoring.Restorer` and `rotation.Rotation` over one `context.StoreContext`.
"""

from __future__ import annotations

import os
import warnings

# gcsfs's experimental zonal/HNS bucket support probes every bucket first; against the GCS
# emulator that probe hangs for about a minute. We need neither; a user may still opt in.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# DCP warns on every single-process save/load that torch.distributed is not initialized;
# single-process is a supported mode here, so that one message is silenced.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")

from .digest import DigestOfEntry, model_digest  # noqa: E402
from .errors import CheckpointLoadError, PeersLost, StorageUnavailable  # noqa: E402
from .export import load_everything, to_torch_save  # noqa: E402
from .layout import FORMAT_VERSION, MANIFEST_NAME, now_rfc3339, step_dir_name  # noqa: E402
from .listing import format_table, to_json  # noqa: E402
from .manifest import verify  # noqa: E402
from .records import CheckpointInfo, PendingSave  # noqa: E402
from .safe_load import StateMismatch, load_plain  # noqa: E402
from .store import CheckpointStore  # noqa: E402

__all__ = [
    "CheckpointInfo",
    "CheckpointLoadError",
    "CheckpointStore",
    "PendingSave",
    "PeersLost",
    "StateMismatch",
    "StorageUnavailable",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "format_table",
    "load_everything",
    "load_plain",
    "model_digest",
    "DigestOfEntry",
    "now_rfc3339",
    "step_dir_name",
    "to_json",
    "to_torch_save",
    "verify",
]
