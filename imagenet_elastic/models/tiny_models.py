"""Tiny models timm lacks, for the tests and the CPU recipes: `test_vit_distilled` is timm's `test_vit` plus DeiT's
distillation token and head (`deit_tiny_distilled_patch16_224`'s shape). Registered on first use, before a name is
looked up or an export of it built; a timm that ships the name keeps its own."""

from __future__ import annotations

import functools

TEST_VIT_DISTILLED = "test_vit_distilled"
NAMES = (TEST_VIT_DISTILLED,)
TEST_VIT = dict(patch_size=16, embed_dim=64, depth=6, num_heads=2, mlp_ratio=3, dynamic_img_size=True)  # timm's


@functools.cache
def register() -> None:
    """Put the tiny models in timm's registry (once per process; a name timm already has is left alone)."""
    import timm
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
    from timm.models.deit import VisionTransformerDistilled

    if timm.is_model(TEST_VIT_DISTILLED):
        return
    global default_cfgs  # timm's register_model reads the entry point's module's `default_cfgs`
    default_cfgs = generate_default_cfgs({f"{TEST_VIT_DISTILLED}.untrained": {
        "num_classes": 1000, "input_size": (3, 160, 160), "crop_pct": 0.95, "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD, "first_conv": "patch_embed.proj",
        "classifier": ("head", "head_dist")}})

    def test_vit_distilled(pretrained: bool = False, **kwargs):  # the name timm registers it under
        return build_model_with_cfg(VisionTransformerDistilled, TEST_VIT_DISTILLED, pretrained,
                                    **dict(TEST_VIT, **kwargs))

    test_vit_distilled.__module__ = __name__
    register_model(test_vit_distilled)
