"""Documents for a model whose chat template has no place for them, written into the text.

vLLM's `documents` (a RAG request's sources, each a JSON object of strings such as
"title" and "text") go to a chat template that reads them (it mentions `documents`).
Other templates (the bundled SmolLM2's among them) would drop them silently, so for
those the documents are written into the system message instead (one is added when
there is none), each in a `<document>` block of its fields.
"""

from __future__ import annotations

from conveyor.tokenizer.conversation import with_system_text

INSTRUCTIONS = "Use these documents to answer:\n<documents>\n{documents}\n</documents>"


def template_knows_documents(template: str | dict) -> bool:
    """Whether a chat template's source reads documents (mentions them at all)."""
    return "documents" in str(template)


def with_documents_in_text(conversation: list[dict], documents: list[dict]) -> list[dict]:
    """The conversation with `documents` written into its system message."""
    return with_system_text(conversation, INSTRUCTIONS.format(
        documents="\n".join(_block(d) for d in documents)))


def _block(document: dict) -> str:
    fields = "\n".join(f"{name}: {value}" for name, value in document.items())
    return f"<document>\n{fields}\n</document>"
