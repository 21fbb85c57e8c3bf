"""Fits the acceptance models of the ``confidence`` and ``adaptive`` controllers from step records.

Per drafter: every judged draft token (those up to the first rejection of a step) becomes one example,
its :func:`~specdecode.control.model_file.feature_row` against whether it was accepted; an L2-regularised
logistic regression is fitted by Newton's method (numpy, standardised features). One request in five
is held out for the validation figures; the model saved is then refitted on all examples. It does not
read or write files (see ``records.py`` and ``model_file.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from specdecode.control.model_file import AcceptanceModel, feature_names, feature_row
from specdecode.control.records import step_record


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0, iterations: int = 50) -> tuple[np.ndarray, float]:
    """Weights and intercept of P(y = 1 | x) = sigmoid(x @ w + b), in the units of ``x``.

    Args:
        x: ``[n, d]`` inputs; a constant column gets weight 0.
        y: ``[n]`` labels 0/1.
        l2: penalty on the standardised weights (not on the intercept).
        iterations: most Newton steps (it stops earlier once converged).
    """
    mean, std = x.mean(0), x.std(0)
    std = np.where(std > 0, std, 1.0)
    z = np.hstack([np.ones((len(x), 1)), (x - mean) / std])
    penalty = np.full(z.shape[1], l2)
    penalty[0] = 0.0
    beta = np.zeros(z.shape[1])
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ beta, -30, 30)))
        grad = z.T @ (p - y) + penalty * beta
        hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.abs(step).max() < 1e-8:
            break
    w = beta[1:] / std
    return w, float(beta[0] - (w * mean).sum())


def _metrics(model: AcceptanceModel, rows: list[list[float]], labels: list[float]) -> dict[str, float]:
    p = np.clip(np.array([model.predict(r) for r in rows]), 1e-6, 1 - 1e-6)
    y = np.array(labels)
    return {"samples": len(y), "log_loss": round(float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()), 4),
            "accuracy": round(float(((p >= 0.5) == (y == 1)).mean()), 4), "base_rate": round(float(y.mean()), 4)}


def examples(lines: Sequence[dict[str, Any]]) -> dict[str, tuple[tuple[str, ...], list[tuple[str, list[float], float]]]]:
    """drafter -> (its signal names, [(request key, feature row, accepted)]) for every judged token with a signal.

    Raises:
        ValueError: one drafter's records carry different signal names.
    """
    out: dict[str, tuple[tuple[str, ...], list[tuple[str, list[float], float]]]] = {}
    for line in lines:
        if not line["signals"]:
            continue
        names = tuple(line["signal_names"])
        known, rows = out.setdefault(line["drafter"], (names, []))
        if known != names:
            raise ValueError(f"step records of drafter {line['drafter']!r} carry different signals: "
                             f"{list(known)} and {list(names)}")
        record = step_record(line)
        key = f"{line.get('method')}|{line.get('prompt_id')}|{line.get('repeat')}"
        for i in range(min(record.drafted, record.accepted + 1)):
            rows.append((key, feature_row(record.signals[i], i, record.ctx), float(i < record.accepted)))
    return out


def _fit(drafter: str, names: tuple[str, ...], rows: list[list[float]], labels: list[float], models: tuple[str, ...],
         l2: float) -> AcceptanceModel:
    w, b = fit_logistic(np.array(rows), np.array(labels), l2)
    return AcceptanceModel(drafter, feature_names(names), tuple(round(float(v), 6) for v in w), round(b, 6), models,
                           drafter, len(labels))


def fit_controller(lines: Sequence[dict[str, Any]], aliases: dict[str, str] | None = None,
                   l2: float = 1.0) -> dict[str, AcceptanceModel]:
    """One acceptance model per drafter found in the records.

    Args:
        lines: checked step records (``records.read_records``).
        aliases: drafter -> drafter whose model it reuses (same signals), e.g. {"draft": "layerskip"}.
        l2: penalty of :func:`fit_logistic`.

    Raises:
        ValueError: no judged draft tokens with signals, an alias of an absent drafter, or a drafter
            whose examples are all accepted or all rejected.
    """
    data = examples(lines)
    if not data:
        raise ValueError("the step records hold no drafted tokens with signals (record them with "
                         "`specdecode bench --record-steps FILE` and a drafting method)")
    entries = {}
    for drafter, (names, rows) in data.items():
        labels = [y for _, _, y in rows]
        if len(set(labels)) < 2:
            raise ValueError(f"drafter {drafter!r}: all {len(labels)} recorded tokens were "
                             f"{'accepted' if labels[0] else 'rejected'}; a model needs both outcomes")
        models = tuple(sorted({str(line["model"]) for line in lines if line["drafter"] == drafter}))
        keys = list(dict.fromkeys(k for k, _, _ in rows))
        held = set(keys[4::5]) if len(keys) >= 5 else set()
        train = [r for r in rows if r[0] not in held] if held else rows[:-(len(rows) // 5) or None]
        test = [r for r in rows if r[0] in held] if held else rows[len(train):]
        validation: dict[str, float] = {}
        if test and len({y for _, _, y in train}) == 2:
            split = _fit(drafter, names, [r for _, r, _ in train], [y for _, _, y in train], models, l2)
            validation = _metrics(split, [r for _, r, _ in test], [y for _, _, y in test])
        model = _fit(drafter, names, [r for _, r, _ in rows], labels, models, l2)
        entries[drafter] = replace(model, validation=validation)
    for drafter, source in (aliases or {}).items():
        if source not in entries:
            raise ValueError(f"alias {drafter}={source}: no records of drafter {source!r} "
                             f"(found: {', '.join(sorted(entries))})")
        entries[drafter] = replace(entries[source], drafter=drafter)
    return entries
