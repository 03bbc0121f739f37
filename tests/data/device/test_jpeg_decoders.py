"""--gpu-decoder: each JPEG library of jpeg_decoders.JPEG_DECODERS gives the batch decoder the pixels it expects, on
CPU tensors (nvImageCodec's CPU backend, torchvision's CPU decoder); auto prefers nvImageCodec and says why it did
not take it; a library that cannot run is one line. tests/gpu/test_cuda.py compares them on a GPU."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_names
from makers import photo_like, save_jpeg, write_jpeg
from PIL import Image

from imagenet_elastic.data import pipeline, pixels
from imagenet_elastic.data.augment import Augment
from imagenet_elastic.data.decoding import Decoding
from imagenet_elastic.data.device import gpu_decode, jpeg_decoders
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.errors import CorruptImageError, UserError

CPU = torch.device("cpu")
LIBRARIES = list(jpeg_decoders.JPEG_DECODERS)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Photo-like JPEGs with 4:2:0 chroma and noise with 4:4:4, of sizes that share no multiple; a portrait with an
    EXIF orientation, a greyscale and a progressive JPEG."""
    root = tmp_path_factory.mktemp("jpegs") / "train"
    for i in range(6):
        save_jpeg(str(root / "photo" / f"{i}.jpg"), photo_like(90 + 13 * i, 130 - 7 * i, seed=i))
        write_jpeg(str(root / "noise" / f"{i}.jpg"), 70 + 11 * i, 60 + 5 * i, seed=10 + i, subsampling="4:4:4")
    # a camera's portrait: stored 100 x 60, its EXIF orientation (6) says turn it; PIL, torchvision and the worker's
    # crop box (from the header) take the pixels as stored, and so must every library
    image = Image.fromarray(photo_like(100, 60, seed=20))
    exif = image.getexif()
    exif[0x0112] = 6
    image.save(root / "photo" / "exif_rotated.jpg", format="JPEG", quality=90, exif=exif.tobytes())
    Image.fromarray(photo_like(70, 90, seed=21)).convert("L").save(root / "photo" / "grey.jpg", format="JPEG")
    Image.fromarray(photo_like(90, 70, seed=22)).save(root / "photo" / "progressive.jpg", format="JPEG",
                                                      progressive=True)
    return scan_image_folder(str(root), "train")


@pytest.mark.parametrize("library", LIBRARIES)
def test_each_library_decodes_pils_very_pixels_channels_first(folder, library):
    jpeg = jpeg_decoders.JPEG_DECODERS[library].make(CPU, 1)
    raws = [Path(folder.path(i)).read_bytes() for i in range(len(folder))]
    decoded = jpeg.decode([pixels.byte_tensor(raw) for raw in raws])
    for raw, image in zip(raws, decoded):
        pil = torch.from_numpy(np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))).permute(2, 0, 1)
        assert image is not None and image.shape == pil.shape and torch.equal(image, pil)


def test_nvimgcodec_decodes_a_batch_into_one_tensor_that_torch_allocated(folder):
    """Left to itself nvImageCodec takes each image from CUDA's default memory pool, which torch's counters,
    empty_cache and --micro-batch auto's out-of-memory handling do not see; the batch decoder has it decode
    into views of one uint8 tensor of the batch's bytes (tests/gpu/test_cuda.py counts it on a GPU)."""
    raws = [Path(folder.path(i)).read_bytes() for i in range(len(folder))]
    decoded = jpeg_decoders.NvImageCodecJpeg(CPU, 1).decode([pixels.byte_tensor(raw) for raw in raws])
    batch = decoded[0]._base
    assert batch is not None and batch.dtype == torch.uint8 and batch.dim() == 1
    assert all(image._base is batch for image in decoded)
    assert batch.numel() == sum(image.numel() for image in decoded)
    for raw, image in zip(raws, decoded):
        pil = torch.from_numpy(np.array(Image.open(io.BytesIO(raw)).convert("RGB"))).permute(2, 0, 1)
        assert torch.equal(image, pil)


def test_nvimgcodec_upsamples_chroma_as_libjpeg_turbo_whatever_the_librarys_default(monkeypatch):
    """nvImageCodec 0.8's Python decoder turned chroma upsampling off unless told (`:fancy_upsampling=0` as its
    options' default), 0.9's extensions turn it on: the decoder says which, and 4:2:0 JPEGs keep PIL's pixels
    under a library that defaults to off."""
    nvimgcodec = jpeg_decoders.import_nvimgcodec()
    made, decoder = [], nvimgcodec.Decoder

    def defaulting_off(*args, options=":fancy_upsampling=0", **kwargs):
        made.append(options)
        return decoder(*args, options=options, **kwargs)

    monkeypatch.setattr(nvimgcodec, "Decoder", defaulting_off)
    noise = np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    raw = io.BytesIO()
    Image.fromarray(noise).save(raw, format="JPEG", quality=90, subsampling="4:2:0")
    image = jpeg_decoders.NvImageCodecJpeg(CPU, 1).decode([pixels.byte_tensor(raw.getvalue())])[0]
    pil = torch.from_numpy(np.array(Image.open(io.BytesIO(raw.getvalue())).convert("RGB"))).permute(2, 0, 1)
    assert (image.int() - pil.int()).abs().max() == 0
    assert made == [":fancy_upsampling=1"]


@pytest.mark.parametrize("library", LIBRARIES)
def test_each_library_gives_the_batch_decoder_the_worker_paths_crops_within_a_level(folder, library):
    augment = Augment(erase=0.5)  # the policy's ops magnify a level (posterize, solarize): test_batch_policy.py
    keys = [(e, i) for e in range(2) for i in range(len(folder))]
    size = 80  # the worker path scales the DCT for crops of 2 x size: none of these images has one
    encoded = pipeline.TrainDataset(folder, size, 7, gpu_decode.encode_bytes, augment)
    decoder = gpu_decode.BatchDecoder(CPU, print, jpeg_decoders.JPEG_DECODERS[library].make(CPU, 1))
    images = decoder(gpu_decode.collate([encoded[key] for key in keys])).images
    workers = torch.stack([pipeline.TrainDataset(folder, size, 7, augment=augment)[key][0] for key in keys])
    assert (images.int() - workers.int()).abs().max() <= 1  # the float resize's rounding against the uint8 kernel


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_jpeg_a_library_cannot_decode_is_a_corrupt_image_error_naming_the_file(tmp_path, library):
    write_jpeg(str(tmp_path / "train" / "a" / "ok.jpg"), 40, 30, seed=1)
    cut = tmp_path / "train" / "a" / "cut.jpg"
    write_jpeg(str(cut), 64, 64, seed=3)
    cut.write_bytes(cut.read_bytes()[:700])  # the header survives: the worker hands it over
    index = scan_image_folder(str(tmp_path / "train"), "train")
    dataset = pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes)
    decoder = gpu_decode.BatchDecoder(CPU, print, jpeg_decoders.JPEG_DECODERS[library].make(CPU, 1))
    with pytest.raises(CorruptImageError, match="cut.jpg"):
        decoder(gpu_decode.collate([dataset[(0, i)] for i in range(len(index))]))


def test_auto_takes_torchvision_the_faster_and_says_why_it_took_the_next_where_one_cannot_run(monkeypatch):
    assert jpeg_decoders.choose("auto", CPU) == ("torchvision", "auto")  # nvimgcodec is installed here too
    assert jpeg_decoders.choose("nvimgcodec", CPU) == ("nvimgcodec", "--gpu-decoder nvimgcodec")
    missing = jpeg_decoders.JPEG_DECODERS["torchvision"]._replace(unavailable=lambda device: "cannot (a stand-in)")
    monkeypatch.setitem(jpeg_decoders.JPEG_DECODERS, "torchvision", missing)
    assert jpeg_decoders.choose("auto", CPU) == ("nvimgcodec", "auto; torchvision cannot (a stand-in)")
    chosen = Decoding.choose("gpu", CPU, 2, Augment())
    assert "by nvimgcodec (auto; torchvision cannot (a stand-in))" in chosen.describe(CPU, Augment())


def test_nvimgcodec_asked_for_where_it_cannot_run_is_one_line_saying_why(monkeypatch):
    if not torch.cuda.is_available():  # every CI machine
        with pytest.raises(UserError) as caught:
            jpeg_decoders.choose("nvimgcodec", torch.device("cuda", 0))
        assert_names(str(caught.value), "--gpu-decoder nvimgcodec", "cuda:0", "no CUDA device")
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # as if not installed
    with pytest.raises(UserError, match=r"^--gpu-decoder nvimgcodec: not installed \(pip install "
                                        r"'imagenet-elastic\[nvimgcodec\]'\)$"):
        jpeg_decoders.choose("nvimgcodec", CPU)
    assert jpeg_decoders.choose("torchvision", CPU) == ("torchvision", "--gpu-decoder torchvision")


def test_importing_nvimgcodec_keeps_its_paragraphs_about_codecs_we_do_not_use_off_the_console():
    """Without its JPEG 2000, TIFF (and here nvJPEG) libraries, nvImageCodec's import prints a paragraph for each."""
    result = subprocess.run([sys.executable, "-c", "from imagenet_elastic.data.device import jpeg_decoders; "
                             "jpeg_decoders.import_nvimgcodec(); print('imported')"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "imported\n" and result.stderr == "", result


def test_a_failed_nvimgcodec_import_gives_back_what_its_libraries_printed(monkeypatch):
    def failing(name):
        os.write(2, b"libnvjpeg.so.13: cannot open\n  shared object file\n")
        raise ImportError(f"no {name}")

    monkeypatch.delitem(sys.modules, "nvidia.nvimgcodec", raising=False)
    monkeypatch.setattr(jpeg_decoders.importlib, "import_module", failing)
    with pytest.raises(ImportError) as caught:
        jpeg_decoders.import_nvimgcodec()
    assert str(caught.value) == "no nvidia.nvimgcodec: libnvjpeg.so.13: cannot open shared object file"


def test_the_command_line_offers_each_library_with_its_help(capsys):
    from imagenet_elastic.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["DATA", "--gpu-decoder", "pillow"])
    assert "invalid choice: 'pillow'" in capsys.readouterr().err
    assert parser.parse_args(["DATA", "--gpu-decoder", "torchvision"]).gpu_decoder == "torchvision"
    shown = " ".join(parser.format_help().split())
    assert all(f"{name} ({info.help})" in shown for name, info in jpeg_decoders.JPEG_DECODERS.items())
