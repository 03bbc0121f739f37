"""The model: timm's, built as a run, a checkpoint or an export needs it (create.py, blurpool.py,
tiny_models.py), on its device and in its precision (device.py), compiled (compile.py, compile_cache.py), with the
weights it starts or learns from (weights.py; a teacher's identity: teacher_weights.py). Below train/ and tools/;
above checkpoint/ and config/, which import none of it."""
