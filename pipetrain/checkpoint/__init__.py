"""Checkpoints: one file per stage plus a manifest, written so that a crash never corrupts the last one.

Layout of a checkpoint directory ``root`` (``layout``)::

    root/step-00000012/stage0.pt ... stageN.pt, manifest.json
    root/latest          # names the newest complete step directory; replaced atomically

Files are written under a temporary name, fsynced and renamed, and the directories are fsynced
before and after ``latest`` flips; ``latest`` flips only after every rank finished, so a save
interrupted at any point (even by a power cut) leaves the previous checkpoint loadable. The
manifest records each stage file's size and sha256, so a truncated, corrupted or mixed-up file is
refused with an error that names it instead of being loaded. Retention never removes the
checkpoint ``latest`` names, and a save refuses to go below a newer checkpoint already published
in the directory (another run's), so neither a rerun nor a rollback can lose a run silently.
Optimizer state is stored by parameter name, so a checkpoint loads into another stage
count or engine (re-partitioned) and ``export_state_dict`` gives the unsplit model's dict.

No process ever holds the whole model: the manifest lists the names each stage file holds, so a load
opens only the files its stages need, and memory-maps them (a tensor is paged in when it is copied into
the stage). It also records the model's canonical names and Hugging Face config, from which
``pipetrain export --hf`` writes a ``from_pretrained`` directory one stage file at a time.

One module per job: ``durable`` (atomic, fsynced writes), ``layout`` (step directories and ``latest``),
``retention`` (publishing and pruning), ``manifest`` (the manifest and the files' sha256), ``optimizer_state``
(by parameter name, the ZeRO merge), ``view`` (what a save or load reads of a pipeline), ``agreement`` (how
the ranks save and load together), ``save``, ``load``, ``export`` (state dict and Hugging Face directory) and
``parts_view`` (an assembled pipeline seen as a ``PipelineView``; not imported here, as it builds on the
assembly, which reads checkpoints for ``weights=``).
"""
from pipetrain.checkpoint.durable import atomic_save, atomic_write_text, fsync_dir
from pipetrain.checkpoint.errors import CheckpointError
from pipetrain.checkpoint.export import PretrainedExport, export_pretrained, export_state_dict
from pipetrain.checkpoint.layout import checkpoint_dir, latest, step_dir, step_dirs
from pipetrain.checkpoint.load import found_everywhere, load_module_state, load_pipeline
from pipetrain.checkpoint.manifest import read_manifest, read_stage_file, read_stage_files
from pipetrain.checkpoint.optimizer_state import merge_optimizer_shares
from pipetrain.checkpoint.retention import prune, publish
from pipetrain.checkpoint.save import save_pipeline
from pipetrain.checkpoint.view import CheckpointRole, PipelineView, StageState, agree_alone

__all__ = ["CheckpointError", "CheckpointRole", "PipelineView", "PretrainedExport", "StageState", "agree_alone",
           "atomic_save", "atomic_write_text", "checkpoint_dir", "export_pretrained", "export_state_dict",
           "found_everywhere", "fsync_dir", "latest", "load_module_state", "load_pipeline", "merge_optimizer_shares",
           "prune", "publish", "read_manifest", "read_stage_file", "read_stage_files", "save_pipeline", "step_dir",
           "step_dirs"]
