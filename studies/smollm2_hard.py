"""A competent SmolLM2 and its hard tail (issue 67): the base the methods are tried on.

    python -m studies.smollm2_hard --out=runs/smollm2_hard               # every stage, resumable
    python -m studies.smollm2_hard --out=runs/smollm2_hard --until=accuracy

Stages, each written to <out>/ when it ends and read back instead of run again:
1. sft:        SmolLM2-135M-Instruct (the bundled GGUF) taught by LoRA SFT (rl/sft.py) to write
               chain_sum's worked solutions (a running total a line, data/worked_solutions.py) on
               easy settings, as the papers' instruct bases write solutions of their oracle's
               kind. Writes sft_adapter/ (PEFT, bf16) and sft.json; base/ is the bundled
               weights with that adapter merged, rebuilt from it where absent (so a copy of the
               committed docs/results/smollm2_hard/sft_adapter in <out> skips the training).
2. accuracy:   the competent base's exact accuracy by chain length and digits, on problems fresh
               by question text (none is an SFT question): pass@1 and pass@k of k samples at the
               run's temperature. accuracy.json.
3. hard:       the hard tail: the setting chosen (--hard-terms, --hard-digits), its problems
               (fresh), the ones solved 0 of k times. hard_set.json.
4. prefixes:   the prefix-solvability table: for each guidance mode (POPE's 'instruction', the
               prefix in the prompt with an instruction to continue; 'solution_prefix', the
               prefix as the start of the answer) and prefix length up to half the solution,
               how many hard problems are solved at least once in k samples. prefixes.json.
5. arms:       the study, where the table shows guidance that unlocks the tail: GRPO, POPE
               (--arm-guidance, prefixes up to --arm-prefix-units lines) and PrefixRL, each an
               rl run through the library's Python door (api.run) at --arm-flops (mining
               included), and the more-SFT control at the same FLOPs (studies/smollm2_arms.py);
               --arm-seeds. Each is resumable; arms/<arm>-s<seed>/ holds its run. --check-arms
               only preflights them.
Every sampled token is booked in ledger.json (2 N D), every update in sft.json (6 N D).

A second base goes on from a committed adapter: --sft-from=.../sft_adapter with the SFT's own
--sft-terms/--sft-digits (fresh problems then leave out every earlier SFT's questions too).

Right is exact (the generator's score of 1.0, reasoning_gym_right_boxed: read leniently, the last
box or the last number); the prompt is smollm2_learns' (a system prompt asking for the box, the
question, "Put the final answer in \\boxed{}.").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from jaxprefix import run_config, storage, variants
from jaxprefix.checkpoints.hf import save_pretrained
from jaxprefix.checkpoints.peft import load_peft_adapter, save_peft_adapter
from jaxprefix.data import reasoning_gym_problems
from jaxprefix.methods import pope
from jaxprefix.methods.prompting import oracle_units
from jaxprefix.models import lora
from jaxprefix.rl import sft
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.run_setup.mining import ProbeSettings
from jaxprefix.run_setup.policy import load_policy

STAGES = ("sft", "accuracy", "hard", "prefixes", "arms")
TASK = "chain_sum"
VERIFIER = "reasoning_gym_right_boxed"  # reward > 0.5 exactly when the answer is right
SFT_SEED, SFT_PROBLEMS = 1, 4096
# Fresh problems: seeds far from the SFT set's (reasoning-gym seeds entry i with seed + i), and
# every question the SFT set holds left out by text besides.
ACCURACY_SEED, HARD_SEED, TEST_SEED = 1 << 31, 1 << 32, 3 << 31


@dataclasses.dataclass(frozen=True)
class StudySettings:
    out: str
    sft: sft.SftSettings
    sft_terms: tuple[int, int]  # the SFT problems' chain lengths, least and most
    sft_digits: tuple[int, int]
    grid: tuple[tuple[int, int], ...]  # the accuracy table's (terms, digits) settings
    sft_from: str | None  # a PEFT adapter the SFT goes on from (None: fresh adapters)
    lora_rank: int
    accuracy_problems: int
    accuracy_k: int
    hard_terms: int
    hard_digits: int
    hard_problems: int
    hard_k: int
    prefix_problems: int
    prefix_k: int
    rows_per_call: int
    arm_seeds: tuple[int, ...]
    arm_flops: float            # each arm's FLOPs budget, mining included
    arm_train_size: int         # training problems of the hard setting (mining finds the hard)
    arm_guidance: str           # POPE's guidance mode, from the prefix table
    arm_prefix_units: int       # the longest prefix POPE's search tries


def chain_config(terms: int, digits: int) -> dict:
    return dict(min_terms=terms, max_terms=terms, min_digits=digits, max_digits=digits)


def run_config_for(model_source: str, model_path: str, rows_per_call: int):
    """The run config the study samples with: smollm2_learns' prompts and temperature."""
    config = run_config.base_config()
    variants.smollm2_learns(config)
    config.model.update(source=model_source, path=model_path)
    config.data.verifier = VERIFIER
    config.mining.rows_per_call = rows_per_call
    return config


class Study:
    def __init__(self, s: StudySettings):
        self.s = s
        storage.makedirs(s.out)
        self._sft_questions = None
        self._policy = None
        self.ledger = self._load_ledger()

    # --- files ----------------------------------------------------------------------------
    def path(self, name: str) -> str:
        return os.path.join(self.s.out, name)

    def done(self, name: str) -> dict | None:
        return storage.read_json(self.path(name)) if storage.exists(self.path(name)) else None

    def write(self, name: str, record: dict) -> None:
        storage.write_json(self.path(name), record, indent=1)
        print(f"wrote {self.path(name)}")

    def _load_ledger(self) -> dict:
        return self.done("ledger.json") or {}

    def book(self, stage: str, ledger: ComputeLedger) -> None:
        self.ledger[stage] = ledger.to_dict()
        self.write("ledger.json", self.ledger)

    # --- problems -------------------------------------------------------------------------
    def sft_task_config(self) -> dict:
        (min_terms, max_terms), (min_digits, max_digits) = self.s.sft_terms, self.s.sft_digits
        return dict(min_terms=min_terms, max_terms=max_terms, min_digits=min_digits,
                    max_digits=max_digits)

    def sft_problems(self):
        return reasoning_gym_problems(TASK, SFT_PROBLEMS, SFT_SEED, **self.sft_task_config())

    def earlier_sft_problems(self):
        """The problems of every SFT the base went on from (each adapter's sft.json beside it)."""
        problems, source = [], self.s.sft_from
        while source:
            record = storage.read_json(os.path.join(os.path.dirname(source.rstrip("/")),
                                                    "sft.json"))
            problems += reasoning_gym_problems(record["task"],
                                               record.get("problems", record["examples"]),
                                               record["seed"], **record["task_config"])
            source = record.get("continued_from")
        return problems

    def fresh(self, size: int, seed: int, terms: int, digits: int):
        """`size` problems at (terms, digits) whose questions no SFT problem (of this base's
        SFT or any it went on from) has."""
        if self._sft_questions is None:
            self._sft_questions = {p.question for p in
                                   self.sft_problems() + self.earlier_sft_problems()}
        problems = reasoning_gym_problems(TASK, size, seed, **chain_config(terms, digits))
        return [p for p in problems if p.question not in self._sft_questions]

    # --- the policy -----------------------------------------------------------------------
    def policy(self):
        """The competent base: the bundled SmolLM2 with sft_adapter/ merged, in <out>/base
        (trained first where sft_adapter/ is absent; merged where base/ is)."""
        if self._policy is None:
            if self.done("sft.json") is None:
                self.train_sft()
            if not storage.exists(self.path("base/config.json")):
                self.merge_sft_adapter()
            config = run_config_for("hf", self.path("base"), self.s.rows_per_call)
            self._policy = (load_policy(config, self.s.out), config)
        return self._policy

    def train_sft(self) -> None:
        """sft_adapter/ (PEFT, bf16: the committed adapter is the measured one) and sft.json."""
        config = run_config_for("gguf", "bundled", self.s.rows_per_call)
        policy = load_policy(config, self.s.out)
        problems = [p for p in self.sft_problems() if p.solution]
        examples = [(p, policy.prompts.response(p.solution)) for p in problems]
        rows = sft.sft_rows(policy.prompts, policy.stop_ids[0], examples)
        if self.s.sft_from:
            model = load_peft_adapter(policy.model, self.s.sft_from)
        else:
            model = lora.with_adapters(policy.model, lora.LoraConfig(rank=self.s.lora_rank),
                                       seed=self.s.sft.seed)
        start = time.time()
        report = sft.train(model, rows, self.s.sft, progress="SFT on worked solutions")
        save_peft_adapter(model, self.path("sft_adapter"), base_model_name_or_path="bundled",
                          dtype="bfloat16")
        self.write("sft.json", report | {"task": TASK, "task_config": self.sft_task_config(),
                                         "seed": SFT_SEED, "problems": SFT_PROBLEMS, "lora_rank": self.s.lora_rank,
                                         "continued_from": self.s.sft_from,
                                         "seconds": time.time() - start})

    def merge_sft_adapter(self) -> None:
        """<out>/base: the bundled GGUF's weights with sft_adapter/ folded in (an HF directory
        with the tokenizer and chat template)."""
        policy = load_policy(run_config_for("gguf", "bundled", self.s.rows_per_call), self.s.out)
        adapted = load_peft_adapter(policy.model, self.path("sft_adapter"))
        save_pretrained(lora.merged(adapted), None, self.path("base"), tokenizer=policy.tokenizer)

    def prober(self, policy, config):
        ledger = ComputeLedger(policy.model.config.num_params())
        return ProbeSettings.from_config(config).prober(policy, ledger, VERIFIER), ledger

    # --- stages ---------------------------------------------------------------------------
    def accuracy(self) -> dict:
        if (record := self.done("accuracy.json")) is not None:
            return record
        policy, config = self.policy()
        prober, ledger = self.prober(policy, config)
        k, rows = self.s.accuracy_k, []
        for terms, digits in self.s.grid:
            problems = self.fresh(self.s.accuracy_problems, ACCURACY_SEED, terms, digits)
            result = prober.probe([policy.prompts.question(p) for p in problems], problems, k,
                                  seed=terms * 10 + digits, description=f"{terms}x{digits}")
            counts = result.num_correct.tolist()
            rows.append({"terms": terms, "digits": digits, "problems": len(problems),
                         "pass@1": sum(counts) / (k * len(problems)),
                         f"pass@{k}": sum(c > 0 for c in counts) / len(problems),
                         "correct_counts": counts})
            print(f"{terms} terms x {digits} digits: pass@1 {rows[-1]['pass@1']:.3f}, "
                  f"pass@{k} {rows[-1][f'pass@{k}']:.3f}")
        self.book("accuracy", ledger)
        record = {"k": k, "temperature": config.rollout.temperature, "seed": ACCURACY_SEED,
                  "rows": rows}
        self.write("accuracy.json", record)
        return record

    def hard(self) -> dict:
        if (record := self.done("hard_set.json")) is not None:
            return record
        policy, config = self.policy()
        s = self.s
        problems = self.fresh(s.hard_problems, HARD_SEED, s.hard_terms, s.hard_digits)
        # Blocks of ~1,024 samples, each kept as it ends (hard_set.partial.json): a large k
        # (the paper's 128) is hours, and a rerun goes on. Block b samples with seed 7 + b.
        per_block = max(1, 1024 // s.hard_k)
        partial = self.done("hard_set.partial.json") or {"k": s.hard_k, "solve_counts": {}}
        if partial["k"] != s.hard_k:
            raise SystemExit(f"{self.path('hard_set.partial.json')}: k={partial['k']}, not "
                             f"--hard-k={s.hard_k}; remove it or use another --out")
        counts = partial["solve_counts"]
        for b, start in enumerate(range(0, len(problems), per_block)):
            block = problems[start:start + per_block]
            if all(p.id in counts for p in block):
                continue
            prober, ledger = self.prober(policy, config)
            result = prober.probe([policy.prompts.question(p) for p in block], block, s.hard_k,
                                  seed=7 + b, description=f"hard set, pass@{s.hard_k}, "
                                  f"block {b + 1} of {-(-len(problems) // per_block)}")
            counts |= {p.id: int(c) for p, c in zip(block, result.num_correct)}
            self.book("hard" if b == 0 else f"hard {b}", ledger)
            self.write("hard_set.partial.json", {"k": s.hard_k, "solve_counts": counts})
        record = {"terms": s.hard_terms, "digits": s.hard_digits, "k": s.hard_k,
                  "seed": HARD_SEED, "problems": len(problems),
                  "pass@1": sum(counts.values()) / (s.hard_k * len(problems)),
                  "solve_counts": counts, "hard_ids": [i for i, c in counts.items() if c == 0]}
        self.write("hard_set.json", record)
        return record

    def prefixes(self) -> dict:
        if (record := self.done("prefixes.json")) is not None and "unguided" in record:
            return record
        hard = self.hard()
        policy, config = self.policy()
        prober, ledger = self.prober(policy, config)
        s = self.s
        by_id = {p.id: p for p in self.fresh(s.hard_problems, HARD_SEED, s.hard_terms,
                                             s.hard_digits)}
        problems = [by_id[i] for i in hard["hard_ids"]][:s.prefix_problems]
        # Each (mode, length) cell is kept as it ends (prefixes.partial.json): a rerun goes on.
        record = self.done("prefixes.partial.json") or {
            "k": s.prefix_k, "problems": [p.id for p in problems], "modes": {}}
        if record["problems"] != [p.id for p in problems] or record["k"] != s.prefix_k:
            raise SystemExit(f"{self.path('prefixes.partial.json')}: another hard subset or k; "
                             f"remove it or use another --out")
        half = min(oracle_units(p) for p in problems) // 2
        if "unguided" not in record:  # the control: the same problems drawn again, unguided
            ledger = prober.ledger = ComputeLedger(ledger.n_params)
            result = prober.probe([policy.prompts.question(p) for p in problems], problems,
                                  s.prefix_k, seed=100, description="unguided, drawn again")
            counts = result.num_correct.tolist()
            record["unguided"] = {"solved": sum(c > 0 for c in counts) / len(problems),
                                  "pass@1": sum(counts) / (s.prefix_k * len(problems)),
                                  "correct_counts": counts}
            print(f"unguided, drawn again: solved {record['unguided']['solved']:.3f}")
            self.book("prefixes unguided", ledger)
            self.write("prefixes.partial.json", record)
        for mode in pope.GUIDANCE_MODES:
            by_length = record["modes"].setdefault(mode, {})
            for units in range(1, half + 1):
                if str(units) in by_length:
                    continue
                ledger = prober.ledger = ComputeLedger(ledger.n_params)  # this cell's alone
                guided = [pope.guided_context(policy.prompts, p, units, guidance=mode)
                          for p in problems]
                result = prober.probe([c for c, _ in guided], problems, s.prefix_k,
                                      seed=100 + units, response_prefixes=[r for _, r in guided],
                                      description=f"{mode}, {units} lines")
                counts = result.num_correct.tolist()
                cell = {"solved": sum(c > 0 for c in counts) / len(problems),
                        "pass@1": sum(counts) / (s.prefix_k * len(problems)),
                        "correct_counts": counts}
                by_length[str(units)] = cell
                print(f"{mode}, {units} of {oracle_units(problems[0])} lines: solved "
                      f"{cell['solved']:.3f}, pass@1 {cell['pass@1']:.3f}")
                self.book(f"prefixes {mode} {units}", ledger)
                self.write("prefixes.partial.json", record)
        self.write("prefixes.json", record)
        return record


def tables(accuracy: dict, hard: dict, prefixes: dict) -> str:
    """The markdown tables of the three records: accuracy by setting, the hard set, and the
    prefix-solvability table."""
    k = accuracy["k"]
    lines = [f"| terms | digits | problems | pass@1 ({k} samples at T = {accuracy['temperature']}) "
             f"| pass@{k} |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['terms']} | {r['digits']} | {r['problems']} | {r['pass@1']:.3f} | "
              f"{r[f'pass@{k}']:.3f} |" for r in accuracy["rows"]]
    hard_ids = hard["hard_ids"]
    lines += ["", f"Hard tail: {hard['terms']} terms of {hard['digits']} digits, "
              f"{hard['problems']} fresh problems, pass@1 {hard['pass@1']:.4f} over "
              f"{hard['k']} samples each; **{len(hard_ids)} of {hard['problems']} solved 0 of "
              f"{hard['k']}** (the hard set).", ""]
    if prefixes is not None:
        n = len(prefixes["problems"])
        lines += [f"| guidance | prefix lines | hard problems solved at least once in "
                  f"{prefixes['k']} (of {n}) | pass@1 |", "|---|---:|---:|---:|"]
        if "unguided" in prefixes:  # the same problems drawn again: what chance alone solves
            row = prefixes["unguided"]
            lines.append(f"| none (drawn again) | 0 | {row['solved']:.3f} "
                         f"({round(row['solved'] * n)}) | {row['pass@1']:.4f} |")
        for mode, by_length in prefixes["modes"].items():
            for units, row in by_length.items():
                lines.append(f"| {mode} | {units} | {row['solved']:.3f} "
                             f"({round(row['solved'] * n)}) | {row['pass@1']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(accuracy: dict, path: str) -> None:
    """pass@1 against chain length, a line per digit count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.5))
    for digits in sorted({r["digits"] for r in accuracy["rows"]}):
        rows = [r for r in accuracy["rows"] if r["digits"] == digits]
        axis.plot([r["terms"] for r in rows], [r["pass@1"] for r in rows], marker="o",
                  label=f"{digits}-digit terms")
    axis.set(xlabel="terms in the chain", ylabel="pass@1 (exact)",
             title="the competent base, fresh problems")
    axis.set_yscale("symlog", linthresh=0.01)
    axis.legend()
    figure.tight_layout()
    storage.write_figure(path, figure, dpi=120)
    plt.close(figure)


def int_range(text: str) -> tuple[int, int]:
    """'2-8' -> (2, 8); '3' -> (3, 3)."""
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def settings_from(args) -> StudySettings:
    return StudySettings(
        out=args.out, sft_terms=int_range(args.sft_terms), sft_digits=int_range(args.sft_digits),
        grid=tuple((t, d) for t in int_list(args.grid_terms) for d in int_list(args.grid_digits)),
        sft_from=args.sft_from,
        sft=sft.SftSettings(steps=args.sft_steps, batch_size=args.sft_batch,
                            learning_rate=args.sft_lr, warmup_steps=10, seed=0),
        lora_rank=16, accuracy_problems=args.accuracy_problems, accuracy_k=args.accuracy_k,
        hard_terms=args.hard_terms, hard_digits=args.hard_digits,
        hard_problems=args.hard_problems, hard_k=args.hard_k,
        prefix_problems=args.prefix_problems,
        prefix_k=16, rows_per_call=args.rows_per_call, arm_seeds=int_list(args.arm_seeds),
        arm_flops=args.arm_flops, arm_train_size=args.arm_train_size,
        arm_guidance=args.arm_guidance, arm_prefix_units=args.arm_prefix_units)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/smollm2_hard")
    parser.add_argument("--until", choices=STAGES, default=STAGES[-1])
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--sft-batch", type=int, default=16)
    parser.add_argument("--sft-lr", type=float, default=3e-4)
    parser.add_argument("--sft-terms", default="2-4", help="the SFT chains' lengths, e.g. 2-8")
    parser.add_argument("--sft-digits", default="1-3", help="the SFT terms' digits, e.g. 1-2")
    parser.add_argument("--sft-from", default=None,
                        help="a PEFT adapter to go on training (e.g. a committed sft_adapter)")
    parser.add_argument("--grid-terms", default="3,5,7", help="the accuracy table's lengths")
    parser.add_argument("--grid-digits", default="1,2,3", help="the accuracy table's digits")
    parser.add_argument("--accuracy-problems", type=int, default=32)
    parser.add_argument("--accuracy-k", type=int, default=8)
    parser.add_argument("--hard-terms", type=int, default=7)
    parser.add_argument("--hard-digits", type=int, default=3)
    parser.add_argument("--hard-problems", type=int, default=64)
    parser.add_argument("--hard-k", type=int, default=16,
                        help="samples a problem; hard = solved 0 of them (the paper's: 128)")
    parser.add_argument("--prefix-problems", type=int, default=32)
    parser.add_argument("--rows-per-call", type=int, default=256)
    parser.add_argument("--arm-seeds", default="0,1,2")
    # ~6e14: the hard set's mining (64 problems x 16 samples, ~7e13), POPE's prefix search or
    # PrefixRL's rejection sampling (up to 64 samples a hard problem, ~4e14) and then 10-30
    # steps of ~1.8e13: about 8 hours for 3 seeds of every arm on 2 cores.
    parser.add_argument("--arm-flops", type=float, default=6e14,
                        help="each arm's FLOPs budget, its mining included")
    parser.add_argument("--arm-train-size", type=int, default=64)
    parser.add_argument("--arm-guidance", default="solution_prefix",
                        choices=pope.GUIDANCE_MODES)
    parser.add_argument("--arm-prefix-units", type=int, default=4)
    parser.add_argument("--check-arms", action="store_true",
                        help="only check each arm's config (preflight), after the stages")
    args = parser.parse_args(argv)
    study = Study(settings_from(args))
    stages = STAGES[:STAGES.index(args.until) + 1]
    for stage in stages:
        if stage == "sft":
            study.policy()
        elif stage == "arms":  # the arms' own module, which builds on this one's constants
            from studies import smollm2_arms

            (smollm2_arms.check_arms if args.check_arms else smollm2_arms.run_arms)(study)
        else:
            getattr(study, stage)()
    if "prefixes" in stages:
        accuracy = study.accuracy()
        storage.write_atomic(study.path("tables.md"),
                           tables(accuracy, study.hard(), study.prefixes()))
        plot(accuracy, study.path("accuracy.png"))
        print(f"wrote {study.path('tables.md')} and {study.path('accuracy.png')}")
    print(json.dumps(study.ledger, indent=1))


if __name__ == "__main__":
    main()
