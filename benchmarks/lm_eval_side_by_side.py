"""lm-evaluation-harness on the demo model through mtpipe's API, beside the same harness on transformers
(PyTorch) and on mlx-lm's own model class: the scores a user of lm-eval gets, and what they take.

Two local tasks on the demo model's held-out stdlib files (no hub): `stdlib_nextline`, four-way choices of
a file's next line after ten lines (loglikelihood), and `stdlib_ppl`, files of 60 lines
(loglikelihood_rolling). `mtpipe serve` runs in its own process on a free port; lm-eval's
`local-completions` sends it token ids with echo, logprobs 1 and max_tokens 1. Needs lm-eval with its API
extra (`pip install "lm_eval[api]"`); transformers' and mlx-lm's runs are skipped where they cannot load.
Prints each way's metrics and seconds, and the largest difference between mtpipe's and transformers'
log-likelihoods per choice.

    python benchmarks/lm_eval_side_by_side.py [CONCURRENT]
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TASKS = ["stdlib_nextline", "stdlib_ppl"]
NEXTLINE = """task: stdlib_nextline
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/nextline.jsonl}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""
PPL = """task: stdlib_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/ppl.jsonl}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
"""


def write_tasks(into: Path) -> None:
    from mtpipe.training.corpus import held_out_files, read_text

    rng = random.Random(0)
    files = [[x for x in read_text(f).splitlines() if x.strip() and len(x) < 100] for f in held_out_files()]
    files = [lines for lines in files if len(lines) > 40]
    with open(into / "nextline.jsonl", "w") as out:
        for _ in range(120):
            lines = rng.choice(files)
            i = rng.randrange(10, len(lines) - 1)
            choices = [lines[i]] + [rng.choice(rng.choice(files)) for _ in range(3)]
            order = rng.sample(range(4), 4)
            out.write(json.dumps({"context": "\n".join(lines[i - 10 : i]) + "\n",
                                  "choices": [choices[j] for j in order], "gold": order.index(0)}) + "\n")
    with open(into / "ppl.jsonl", "w") as out:
        for lines in files[:12]:
            out.write(json.dumps({"text": "\n".join(lines[:60]) + "\n"}) + "\n")
    (into / "nextline.yaml").write_text(NEXTLINE.format(data=into))
    (into / "ppl.yaml").write_text(PPL.format(data=into))


def evaluate(model: object, args: str | None, tasks_dir: Path) -> tuple[dict, list, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    res = lm_eval.simple_evaluate(model=model, model_args=args, tasks=TASKS, batch_size=1, log_samples=True,
                                  task_manager=TaskManager(include_path=str(tasks_dir)))
    metrics = {k: {m.split(",")[0]: v for m, v in r.items() if isinstance(v, float) and "stderr" not in m}
               for k, r in res["results"].items()}
    per_choice = sorted((s["doc_id"], [float(r[0]) for r in s["filtered_resps"]])
                        for s in res["samples"]["stdlib_nextline"])
    return metrics, per_choice, time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(concurrent: int) -> None:
    from mtpipe.models.registry import DEMO_MODEL

    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        tasks_dir = Path(tmp)
        write_tasks(tasks_dir)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "mtpipe", "serve", "--port", str(port), "--model-name", "demo"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(240):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                    break
                except OSError:
                    time.sleep(0.5)
            got["mtpipe"] = evaluate("local-completions", f"model=demo,base_url=http://127.0.0.1:{port}/v1/completions,"
                                     f"tokenizer={DEMO_MODEL},tokenizer_backend=huggingface,tokenized_requests=True,"
                                     f"num_concurrent={concurrent},max_retries=1", tasks_dir)
        finally:
            server.terminate()
            server.wait(30)
        try:
            got["transformers"] = evaluate("hf", f"pretrained={DEMO_MODEL},dtype=float32,device=cpu", tasks_dir)
        except Exception as e:  # noqa: BLE001 - a peer that cannot load here is reported, not fatal
            print(f"transformers: skipped ({type(e).__name__}: {e})")
        try:
            from mlx_lm.evaluate import MLXLM

            got["mlx-lm MLXLM"] = evaluate(MLXLM(str(DEMO_MODEL)), None, tasks_dir)
        except Exception as e:  # noqa: BLE001
            print(f"mlx-lm: skipped ({type(e).__name__}: {e})")
    for way, (metrics, _, seconds) in got.items():
        print(f"{way}: {seconds:.1f} s {json.dumps(metrics)}")
    if "transformers" in got:
        diff = max(abs(a - b) for (_, x), (_, y) in zip(got["mtpipe"][1], got["transformers"][1]) for a, b in zip(x, y))
        print(f"largest difference per choice, mtpipe against transformers: {diff:.2e}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
