"""Where a model comes from, parsed once into a typed value. torch-free: the operator and the CRD use it.

A model source is user input that ends up in container arguments and file paths, so it is held to a
strict grammar: a bundled name, `https://host/path/file.gguf`, `hf://org/repo[/path/in/repo]` or
`pvc://claim/path`. Path segments are letters, digits and `._+-` only (no quotes, spaces, shell
metacharacters, `%` escapes or query strings), and no segment is `.` or `..`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_SEG = r"[A-Za-z0-9_.+-]+"
_NAME = r"[a-z0-9][a-z0-9.-]*"
_HOST = r"[A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]{1,5})?"
# The one grammar, written so that the API server (OpenAPI pattern, RE2) and pydantic check the same.
MODEL_SOURCE_PATTERN = (rf"^({_NAME}|https://{_HOST}(/{_SEG})*/{_SEG}\.gguf|hf://{_SEG}/{_SEG}(/{_SEG})*|pvc://{_NAME}(/{_SEG})+)$")
# `.` and `..` segments match _SEG too; they are refused by this second rule (CEL in the CRD).
DOT_SEGMENT_PATTERN = r"(^|/)[.][.]?(/|$)"  # no backslashes: the CRD spells it inside a CEL string


class InvalidModelSource(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: Literal["bundled", "https", "hf", "pvc"]
    raw: str
    name: str = ""        # bundled: the model name; hf: "org/repo"; pvc: the claim
    path: str = ""        # hf: the file inside the repo ("" = the whole repo); pvc: the file on the claim
    url: str = ""         # https: the URL

    @property
    def filename(self) -> str:
        """The downloaded file's name (https, and hf with a file), or a whole hf repository's directory name."""
        return (self.url or self.path or self.name).rsplit("/", 1)[-1]



def parse_model_source(source: str) -> ModelSource:
    if not isinstance(source, str) or len(source) > 512 or not re.fullmatch(MODEL_SOURCE_PATTERN, source):
        raise InvalidModelSource(f"model source {source!r} is not one of: a bundled model name, https://host/path/file.gguf, "
                                 "hf://org/repo[/path/file], pvc://claim/path (letters, digits and ._+- in paths)")
    if re.search(DOT_SEGMENT_PATTERN, source.split("://", 1)[-1]):
        raise InvalidModelSource(f"model source {source!r}: path segments '.' and '..' are not allowed")
    if source.startswith("https://"):
        return ModelSource("https", source, url=source)
    if source.startswith("hf://"):
        org, repo, *rest = source[len("hf://"):].split("/")
        return ModelSource("hf", source, name=f"{org}/{repo}", path="/".join(rest))
    if source.startswith("pvc://"):
        claim, *rest = source[len("pvc://"):].split("/")
        return ModelSource("pvc", source, name=claim, path="/".join(rest))
    return ModelSource("bundled", source, name=source)
