"""Task generators by kind: one module per kind, one line here."""

from kvlab.tasks import needle

GENERATORS = {
    "niah_single": needle.generate,
}
