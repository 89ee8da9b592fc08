"""Linear-time tables over one long piece: the encoding of every prefix, of every suffix, and of
any sub-range (the rust-gems ``bpe`` algorithms, in Python).

The tables walk symbols: bytes for a byte-level vocabulary, code points for a SentencePiece one
(``bpe.radix`` says which, ``bpe.buffer`` makes the sequence). Pieces are usually a word, and :meth:`ByteLevelBPE.encode_piece` handles them. A piece can also
be a megabyte long (``'a' * n``, letters with no space, a whitespace run): then re-encoding
pieces of it over and over would be quadratic. These tables work on the piece's model bytes
(:meth:`ByteLevelBPE.model_bytes`) and never re-encode more than a bounded window:

- :class:`PrefixEncoder`: append bytes; the last token and token count of every prefix
  ``data[:i]``. The last token of ``data[:i]`` is the suffix token ``t`` (longest first, walking a
  trie of reversed tokens) that forms a valid pair with the last token of ``data[:i - len(t)]``.
- :class:`SuffixEncoder`: the mirror image, computed leftwards from the end on demand: first
  token and count of every suffix ``data[i:]``.
- :class:`PieceIntervals`: the suffix table of a whole piece plus a pre-order numbering of its
  tree (node i's parent is ``i + len(first[i])``), so that "is p on the path from x" is O(1).
  ``count(x, y)`` joins the path of ``data[x:]`` up to a node p shortly before y with a direct
  encoding of ``data[p:y]``; if the two tokens at the join form a valid pair the whole is valid,
  otherwise p moves left in growing steps (at worst ``data[x:y]`` is encoded directly, which is
  linear too).

Window rule used to stop early: a token is at most ``max_token_len`` bytes long, so the encoding
of any longer prefix passes through one of the last ``max_token_len`` positions, and a prefix
encoding has more tokens than any prefix of it at a token boundary. Once every one of
``max_token_len`` consecutive positions needs more than n tokens, no longer prefix fits in n.
"""

from __future__ import annotations

from array import array

from parrot.tokenizer.bpe import ByteLevelBPE, TokenId


def _zeros(n: int) -> array[int]:
    return array("i", bytes(4 * n))


class PrefixEncoder:
    """Appendable: the last token and count of the encoding of every prefix of the bytes so far."""

    def __init__(self, bpe: ByteLevelBPE) -> None:
        self._bpe = bpe
        self._children, self._token = bpe.suffix_trie()
        self.data = bpe.buffer()
        self.last: array[int] = array("i", [-1])  # last[i]: last token of the encoding of data[:i]
        self.depth: array[int] = array("i", [0])  # depth[i]: its number of tokens

    def __len__(self) -> int:
        return len(self.data)

    def extend(self, data: bytes) -> None:
        bpe, children, token, token_len = self._bpe, self._children, self._token, self._bpe.token_len
        radix = bpe.radix
        pairs, vocab = bpe._pairs, bpe.vocab_size
        buf, last, depth = self.data, self.last, self.depth
        for byte in data:
            buf.append(byte)
            i = len(buf)
            node, k, candidates = 0, i - 1, []
            while k >= 0:
                node = children.get(node * radix + buf[k], -1)
                if node < 0:
                    break
                if token[node] >= 0:
                    candidates.append(token[node])
                k -= 1
            for tid in reversed(candidates):  # longest first
                j = i - token_len[tid]
                ok: bool | None
                if j == 0:
                    ok = bpe.reachable(tid)
                else:
                    ok = pairs.get(last[j] * vocab + tid)
                    if ok is None:
                        ok = bpe.valid_pair(last[j], tid)
                if ok:
                    last.append(tid)
                    depth.append(depth[j] + 1)
                    break
            else:
                raise AssertionError("no valid last token: the vocabulary breaks a BPE invariant")

    def truncate(self, n: int) -> None:
        """Forget the bytes after ``n`` (the tables of shorter prefixes do not depend on them)."""
        del self.data[n:]
        del self.last[n + 1 :]
        del self.depth[n + 1 :]

    def count(self, i: int | None = None) -> int:
        return self.depth[len(self.data) if i is None else i]

    def tokens(self, i: int | None = None) -> list[TokenId]:
        i = len(self.data) if i is None else i
        out = []
        while i > 0:
            out.append(self.last[i])
            i -= self._bpe.token_len[self.last[i]]
        return out[::-1]


class SuffixEncoder:
    """First token and count of the encoding of every suffix ``data[i:]``, filled leftwards."""

    def __init__(self, bpe: ByteLevelBPE, data: bytes) -> None:
        self._bpe = bpe
        self.data = data if isinstance(data, bytes) else bpe.buffer(data)
        m = len(self.data)
        self.first = _zeros(m + 1)  # first[i]: first token of the encoding of data[i:]
        self.depth = _zeros(m + 1)  # depth[i]: its number of tokens (depth[m] = 0)
        self.lowest = m  # positions >= lowest are filled

    def extend_to(self, i: int) -> None:
        """Fill the tables down to position ``i``."""
        bpe = self._bpe
        children, token = bpe.prefix_trie()
        token_len, pairs, vocab, radix = bpe.token_len, bpe._pairs, bpe.vocab_size, bpe.radix
        data, first, depth, m = self.data, self.first, self.depth, len(self.data)
        for pos in range(self.lowest - 1, i - 1, -1):
            node, k, candidates = 0, pos, []
            while k < m:
                node = children.get(node * radix + data[k], -1)
                if node < 0:
                    break
                if token[node] >= 0:
                    candidates.append(token[node])
                k += 1
            for tid in reversed(candidates):  # longest first
                j = pos + token_len[tid]
                ok: bool | None
                if j == m:
                    ok = bpe.reachable(tid)
                else:
                    ok = pairs.get(tid * vocab + first[j])
                    if ok is None:
                        ok = bpe.valid_pair(tid, first[j])
                if ok:
                    first[pos] = tid
                    depth[pos] = depth[j] + 1
                    break
            else:
                raise AssertionError("no valid first token: the vocabulary breaks a BPE invariant")
        self.lowest = min(self.lowest, i)

    def count(self, i: int) -> int:
        self.extend_to(i)
        return self.depth[i]


class PieceIntervals:
    """Exact token count of any byte range of one long piece after a linear pass."""

    def __init__(self, bpe: ByteLevelBPE, data: bytes) -> None:
        self._bpe = bpe
        suffixes = SuffixEncoder(bpe, data)
        suffixes.extend_to(0)
        self.data, self.first, self.depth = suffixes.data, suffixes.first, suffixes.depth
        m, token_len, first = len(self.data), bpe.token_len, self.first
        size = array("i", [1]) * (m + 1)
        for i in range(m):  # a child's index is below its parent's: children are done first
            size[i + token_len[first[i]]] += size[i]
        order, end, free = _zeros(m + 1), _zeros(m + 1), _zeros(m + 1)
        end[m], free[m] = size[m], 1
        for i in range(m - 1, -1, -1):  # parents first: pre-order numbers
            parent = i + token_len[first[i]]
            order[i] = free[parent]
            free[parent] += size[i]
            free[i] = order[i] + 1
            end[i] = order[i] + size[i]
        self._order, self._end = order, end

    def count(self, x: int, y: int) -> int:
        """Tokens of ``data[x:y]``."""
        bpe, data, first, depth = self._bpe, self.data, self.first, self.depth
        if x >= y:
            return 0
        if y == len(data):
            return depth[x]
        order, end, token_len, span = self._order, self._end, bpe.token_len, bpe.max_token_len
        ox = order[x]
        margin = 16
        while y - margin - span >= x:
            # p: the node of x's path closest below y - margin (some lies in any span-wide window)
            p = next(q for q in range(y - margin, y - margin - span, -1) if order[q] <= ox < end[q])
            # the token of x's path that ends at p
            c = next(q for q in range(p - 1, p - span - 1, -1) if q + token_len[first[q]] == p and order[q] <= ox < end[q])
            tail = bpe.encode_bytes(data[p:y])
            if bpe.valid_pair(first[c], tail[0]):
                return depth[x] - depth[p] + len(tail)
            margin *= 4
        return len(bpe.encode_bytes(data[x:y]))
