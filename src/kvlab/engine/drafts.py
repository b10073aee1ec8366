"""Draft tokens for verified greedy decoding, looked up in the tokens a row has already seen (prompt lookup).

Answers to long-context tasks mostly copy spans of their prompt (a needle's value, a chain of variable names), so
the tokens that followed the latest earlier occurrence of a row's last few tokens are a good guess at what it
decodes next. A decode pass feeds a row its next token and such a guess together; greedy decoding keeps the guessed
tokens its own choices confirm (kvlab.engine.greedy). On a CPU a one-token step at a few rows is bound by reading
the weights, so a pass of several tokens per row costs about what one step costs, and every confirmed token saves
a step. transformers has the same idea (`prompt_lookup_num_tokens` of `generate`) inside its own generation loop,
which knows neither our batched caches nor rows that each drop a different number of tokens; this is ours.
"""

from __future__ import annotations

LONGEST = 3  # the longest suffix of a row's tokens looked up (then shorter ones, down to one token)


class Lookup:
    """The tokens a row has seen, indexed by every n-gram (n <= LONGEST) that something followed: `draft` proposes
    what followed the latest earlier occurrence of the row's longest suffix that occurred before."""

    def __init__(self, tokens: list[int] = ()):
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.extend(tokens)

    def copy(self) -> "Lookup":
        out = Lookup()
        out.tokens, out.after = list(self.tokens), dict(self.after)
        return out

    def extend(self, tokens) -> None:
        """Append tokens the row was fed or chose."""
        seen = self.tokens
        for token in tokens:
            i = len(seen)
            for n in range(1, min(LONGEST, i) + 1):
                self.after[tuple(seen[i - n : i])] = i
            seen.append(token)

    def draft(self, most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of the longest suffix found; none if even
        the last token never occurred before."""
        if most <= 0:
            return []
        for n in range(min(LONGEST, len(self.tokens)), 0, -1):
            at = self.after.get(tuple(self.tokens[-n:]))
            if at is not None:
                return self.tokens[at : at + most]
        return []
