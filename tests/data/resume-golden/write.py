"""Writes a golden checkpoint like this folder's: the tiny model, 6 steps of pmap on 8 fake CPU
devices (tests/test_resume.py's flags), the checkpoint of step 3 and the losses of the
uninterrupted run's steps 4-6. tests/test_resume_versions.py resumes it with the kit of
today, so a kit that can no longer continue a run of this one fails there.

    python tests/data/resume-golden/write.py tests/data/OUT-FOLDER

The files in this folder are an earlier kit's record (README.md): run this only to add
another version's, in a folder of its own.
"""
import json
import os
import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import conftest  # noqa: E402,F401  (eight fake CPU devices, the tests' XLA flags)

import train_pmap  # noqa: E402

FLAGS = ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "80",
         "--synthetic-val", "16", "--synthetic-test", "16", "--steps", "6", "--batch", "16",
         "--no-progress", "--eval-every", "0", "--randaugment", "0", "--accum-steps", "1"]
STEP = 3


def main(out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpts, log = pathlib.Path(tmp) / "ckpts", pathlib.Path(tmp) / "log.jsonl"
        train_pmap.main(FLAGS + ["--ckpt-dir", str(ckpts), "--ckpt-every", str(STEP),
                                 "--log-json", str(log)])
        name = f"step_{STEP:08d}"
        shutil.copytree(ckpts / name, out / name)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        losses = {r["step"]: r["loss"] for r in records
                  if "loss" in r and "split" not in r and r["step"] > STEP}
        (out / "losses.json").write_text(json.dumps(
            {"flags": FLAGS, "resumed_step": STEP, "losses": losses}, indent=1) + "\n")
    print(f"wrote {out / name} and {out / 'losses.json'}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} OUT-FOLDER (a new folder, not this one)")
    target = pathlib.Path(sys.argv[1]).resolve()
    os.chdir(REPO)
    main(target)
