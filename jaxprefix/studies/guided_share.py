"""How much of a POPE arm is what its name claims: its share of guided training contexts, with
its counts, and the floor under which the arm is a defect of the study, not a result (issue 43:
a restating arm that guided 13% of its contexts had been read as "POPE ties GRPO")."""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxprefix.studies.study_tables import Row

# A POPE arm meant to guide g of each problem's g + u contexts (pope.guided_copies,
# unguided_copies) with under 0.9 of that share guided (0.45 at 1:1) is mostly plain GRPO.
GUIDED_SHARE_FLOOR = 0.9


def guided_share(run: dict, design, hard: int) -> dict | None:
    """A POPE run's share of guided training contexts, with its counts: counted in training
    (the record's 'guided_contexts' of 'contexts', jobs/results.py) or, for a record from before
    they were counted, expected from how many of the trained hard problems had a prefix
    ('pope_problems'). `design`: the arm's GuidedDesign (run_setup/study_settings.py), None for
    an arm that is not POPE. None for a run that guides nothing by design."""
    if design is None or "pope_problems" not in run:
        return None
    g, u = design.guided_copies, design.unguided_copies
    if not g:
        return None
    designed = g / (g + u)
    found = run["pope_problems"]
    trained = hard if design.unsolved == "unguided" else found
    out = {"designed": designed, "guided_problems": found, "trained_problems": trained}
    if run.get("contexts"):
        out |= {"guided": run["guided_contexts"], "contexts": run["contexts"], "counted": True,
                "share": run["guided_contexts"] / run["contexts"]}
    else:  # B problems a step, each g + u contexts, plus easy ones
        per_step = design.problems_per_step * (g + u)
        out |= {"counted": False,
                "share": designed * found / trained * per_step / (per_step + design.easy_per_step)}
    out["defect"] = out["share"] < GUIDED_SHARE_FLOOR * designed
    return out


def share_sentence(share: dict) -> str:
    """'guided share 0.13 (6,656 of 51,200 training contexts; designed 0.50)', and the defect."""
    counts = (f"{share['guided']:,} of {share['contexts']:,} training contexts" if share["counted"]
              else f"expected from {share['guided_problems']} of {share['trained_problems']} "
                   f"trained hard problems with a prefix: not counted in training before issue 43")
    text = f"guided share {share['share']:.2f} ({counts}; designed {share['designed']:.2f})"
    if share["defect"]:
        text += (f": **defect: under {GUIDED_SHARE_FLOOR:g} of the designed share, this arm is "
                 f"mostly plain GRPO and its rows are not a result**")
    return text


def marked_rows(rows: list[Row], designs: dict, hard: int) -> list[Row]:
    """`rows` with a POPE arm below its guided-share floor relabelled as a defect (`designs`:
    each POPE arm's GuidedDesign by name)."""
    out = []
    for row in rows:
        shares = [guided_share(r, designs.get(row.label), hard) for r in row.evals]
        if shares and shares[0] is not None and any(s["defect"] for s in shares):
            mean = np.mean([s["share"] for s in shares])
            row = dataclasses.replace(row, label=f"{row.label} (defect: {mean:.2f} guided)")
        out.append(row)
    return out
