"""The model: timm's, built, placed, compiled, and the weights it starts or learns from. Below train/ and tools/;
above checkpoint/ and config/, which import none of it."""
