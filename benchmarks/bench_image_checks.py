"""What prepare-images' and verify --images' checks of an image cost, and what prepare-images holds in memory.

    python benchmarks/bench_image_checks.py [--images 200] [--side 640]

Per image, the fastest of `--repeat` rounds: reading its header (Pillow, no pixel decoded: what `verify
--images` does by default), its sha256, and decoding it as the training loader does
(`prepack.sources.images.decode_failure`: what `prepare-images` does to every image and `verify --images
--decode` adds). The images: matplotlib's sample JPEG and PNG, and a synthetic 1920x1080 JPEG.

Then `prepare_image_chat` over `--images` distinct noise PNGs of `--side`² pixels (noise does not compress,
so each file is about 3·side² bytes), one a record, after one run on one image (which makes the lazy
imports and loads the tokenizer): the peak of the Python heap (tracemalloc), of Arrow's
memory pool and of the process's anonymous memory (RssAnon, sampled every 5 ms), beside the images' total.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image

from prepack.sources.images import decode_failure, prepare_image_chat
from tests.vision_inputs import PHOTOS, SAMPLE_DATA, processor_directory


def fastest(call, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def header(data: bytes) -> None:
    with Image.open(io.BytesIO(data)) as image:
        image.size


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def check_costs(repeat: int) -> None:
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 1920)[None, :, None] + np.linspace(0, 127, 1080)[:, None, None]
    pixels = np.clip(ramp + rng.normal(0, 20, (1080, 1920, 3)), 0, 255).astype(np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, "JPEG", quality=90)
    images = {name: (SAMPLE_DATA / name).read_bytes() for name in PHOTOS[:2]}
    images["synthetic 1920x1080 JPEG"] = encoded.getvalue()
    print("| image | bytes | header ms | sha256 ms | decode ms | decode MB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, data in images.items():
        assert decode_failure(data) is None
        times = [fastest(lambda check=check: check(data), repeat) for check in (header, hashlib.sha256, decode_failure)]
        print(f"| {name} | {len(data):,} | {times[0] * 1e3:.3f} | {times[1] * 1e3:.3f} | {times[2] * 1e3:.1f} | "
              f"{len(data) / times[2] / 1e6:.1f} |")


def corpus_line(number: int) -> str:
    content = [{"type": "image", "image": f"{number}.png"}, {"type": "text", "text": "?"}]
    return json.dumps({"messages": [{"role": "user", "content": content}]}) + "\n"


def memory(count: int, side: int) -> None:
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        processor = processor_directory(root / "processor")
        total = 0
        with open(root / "chats.jsonl", "w") as corpus:
            for number in range(count):
                Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(root / f"{number}.png")
                total += (root / f"{number}.png").stat().st_size
                corpus.write(corpus_line(number))
        # Once before the measure, on one image: the tokenizer's and the lazy imports' allocations.
        (root / "one.jsonl").write_text(corpus_line(0))
        prepare_image_chat(root / "one.jsonl", processor, root / "warm")
        peak, done = [rss_anon()], threading.Event()

        def sample() -> None:
            while not done.wait(0.005):
                peak[0] = max(peak[0], rss_anon())

        before, pool_before = rss_anon(), pa.default_memory_pool().max_memory()
        sampler = threading.Thread(target=sample)
        sampler.start()
        tracemalloc.start()
        start = time.perf_counter()
        prepare_image_chat(root / "chats.jsonl", processor, root / "out")
        seconds = time.perf_counter() - start
        heap = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        done.set()
        sampler.join()
        pool = pa.default_memory_pool().max_memory()
    mib = 2**20
    print(f"\nprepare_image_chat: {count} images of {side}x{side}, {total / mib:.1f} MiB in all "
          f"({total / count / mib:.2f} MiB each), {seconds:.1f} s")
    print(f"peak Python heap (tracemalloc): {heap / mib:.1f} MiB")
    print(f"peak Arrow pool: {pool / mib:.1f} MiB (before: {pool_before / mib:.1f} MiB)")
    print(f"peak RssAnon: {peak[0] / mib:.1f} MiB, {(peak[0] - before) / mib:+.1f} MiB over the "
          f"{before / mib:.1f} MiB before")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--side", type=int, default=640)
    args = parser.parse_args()
    check_costs(args.repeat)
    memory(args.images, args.side)


if __name__ == "__main__":
    main()
