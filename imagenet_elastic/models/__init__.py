"""The model: timm's, built as a run, a checkpoint or an export needs it (create.py, input_size.py, blurpool.py,
tiny_models.py), on its device and in its precision (device.py), compiled (compile.py, compile_cache.py), and the
weights it starts from or learns from that are not the run's own state (published_weights.py: --pretrained,
initial_weights.py: --initial-checkpoint, teacher_weights.py: --teacher), and a whole model from what a user names as
its weights (weights.py: --teacher's and `evaluate MODEL`'s one loader). Below train/ and tools/, which build and
use it; above checkpoint/ (checkpoint files are read through its store.py) and config/, which import none of it."""
