#!/usr/bin/env python3
"""Every C++ block of docs/*.md (```cpp or ```c++) as a source file that CMake compiles and links.

    python3 docs_snippets.py DOCS_DIR OUT_DIR     # writes OUT_DIR/*.cpp (*.cu) and manifest.cmake

A block is a whole translation unit (a main() is added where it has none), unless the line before
its fence ends an HTML comment that starts with `<!-- fragment`; then the block is the inside of a
function: its #include lines go to the top of the file, the comment's lines after the first (up
to `-->`) follow them, then the rest of the block and a closing brace. So the comment opens the
function (its head and `{`) and may define there what the block uses:

    <!-- fragment: what the block assumes
    struct Net : torch::nn::Module { torch::Tensor forward(torch::Tensor x) { return x; } };
    void train(tandem::GlooComm& comm) {
      auto model = std::make_shared<Net>();
    -->
    ```cpp
    ... the block ...
    ```

The comment does not show in the rendered page; in the source it says what the fragment assumes.
An indented block (in a list item) loses its fence's indentation.

manifest.cmake calls tandem_doc_snippet() once per block with NAME (a target name), SOURCE,
WHERE (doc:line), NEEDS (the components its #includes and its fragment comment's need: gloo, mpi,
shm, data, io, torch, cuda, nccl), LINKS (those a "CMake:" comment in the block names, else
those its #includes need, and the fragment comment's) and, for a block with a "CMake:" comment,
LINKED: that block is linked; the others are compiled only (every template they use instantiated,
no code generated: CI's time). A "CMake:" comment that names fewer components than the block's
#includes need stops this script with the block's place (a user copying it would fail to link).

The blocks that need no nvcc share a source per kind, so that the headers are parsed and the
templates instantiated once for all of them rather than once a block (CI's time): blocks.cpp
(compiled only), blocks_linked.cpp (linked), blocks_torch.cpp and blocks_torch_linked.cpp (the
blocks that need libtorch). In it a block is its #includes, then its text inside a namespace of
its own (its target's name) under `#line` directives, so that an error names the doc's line; and
an `#if defined(TANDEM_DOC_<target>)` around it, which CMake defines for the blocks that this build
has the components for. A block that needs nvcc keeps a file of its own (<target>.cu). Files are
rewritten only when their text changes (no rebuild otherwise); files no longer written are removed.
"""
import os
import re
import sys

FENCE = re.compile(r"^(\s*)(`{3,})\s*([A-Za-z0-9_+-]*)\s*$")  # an opening fence and its language
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
# The CMake component an #include needs (the first match wins).
COMPONENTS = [
    (re.compile(r"^tandem/torch/cuda\.hpp$"), ["torch", "cuda", "nccl"]),
    (re.compile(r"^tandem/torch(\.hpp|/)"), ["torch"]),
    (re.compile(r"^tandem/comm/nccl(/|\.hpp|_mpi)"), ["nccl"]),
    (re.compile(r"^tandem/(cuda\.hpp|cuda/)"), ["cuda"]),
    (re.compile(r"^tandem/comm/gloo(/|\.hpp)"), ["gloo"]),
    (re.compile(r"^tandem/comm/mpi(/|\.hpp)"), ["mpi"]),
    (re.compile(r"^tandem/comm/shm/"), ["shm"]),
    (re.compile(r"^tandem/data/(mnist|idx)\.hpp$"), ["data"]),
    (re.compile(r"^tandem/io/(checkpoint|safetensors)\.hpp$"), ["io"]),
]
CMAKE_COMMENT = re.compile(r"//.*CMake:(.*)$")
COMPONENT_NAME = re.compile(r"tandem::(gloo|mpi|shm|data|io|torch|cuda|nccl)\b")


def blocks(path):
    """(line of the fence, fragment context or None, lines of the block) for each C++ block; a
    fence of another language (a Markdown example of a block, say) is skipped whole."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    found = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, language = fence.groups()
        closing = re.compile(r"^\s*`{%d,}\s*$" % len(ticks))
        start = i
        body = []
        i += 1
        while i < len(lines) and not closing.match(lines[i]):
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        if i == len(lines):
            sys.exit(f"docs_snippets: {path}:{start + 1}: the block is never closed")
        if language in ("cpp", "c++"):
            found.append((start + 1, fragment_context(lines, start, path), body))
        i += 1
    return found


def fragment_context(lines, fence, path):
    """(the doc's line of its first C++ line, the C++ lines) of a `<!-- fragment` comment that
    ends on the line before the fence; None where there is none."""
    end = fence - 1
    if end < 0 or not lines[end].strip().endswith("-->"):
        return None
    begin = end
    while begin >= 0 and "<!--" not in lines[begin]:
        begin -= 1
    if begin < 0 or not lines[begin].strip().startswith("<!-- fragment"):
        return None
    if begin == end:
        sys.exit(f"docs_snippets: {path}:{begin + 1}: a fragment comment opens the function its "
                 "block is the inside of, on the lines after `<!-- fragment`")
    context = [line.strip() if i == 0 else line for i, line in enumerate(lines[begin + 1:end + 1])]
    context[-1] = context[-1].rsplit("-->", 1)[0]
    return begin + 2, context


def source_of(context, body):
    """A block's own translation unit: a whole block as it is, or a fragment wrapped into its
    function."""
    if context is None:
        text = "\n".join(body) + "\n"
        if not re.search(r"\bmain\s*\(", text):
            text += "\nint main() {}  // added by tests/compile/docs_snippets.py\n"
        return text
    context = context[1]
    includes = [line for line in body if INCLUDE.match(line)]
    rest = [line for line in body if not INCLUDE.match(line)]
    text = ("\n".join(includes) + "\n\n" + "\n".join(context) + "\n" + "\n".join(rest) +
            "\n}  // added by tests/compile/docs_snippets.py\n")
    if not re.search(r"\bmain\s*\(", "\n".join(context + rest)):
        text += "\nint main() {}  // added by tests/compile/docs_snippets.py\n"
    return text


def section_of(target, doc, line, context, body):
    """A block's part of a shared source: its #includes, then its text (include lines left
    blank, so that the line numbers hold) in a namespace of its own, where a main() of its own
    is an ordinary function; the whole under the macro CMake defines when it builds the block."""
    includes = [text for text in (context[1] if context else []) + body if INCLUDE.match(text)]
    parts = [f"#if defined(TANDEM_DOC_{target})  // {doc}:{line}"] + includes
    parts.append(f"namespace {target} {{")
    if context:
        parts.append(f'#line {context[0]} "{doc}"')
        parts += ["" if INCLUDE.match(text) else text for text in context[1]]
    parts.append(f'#line {line + 1} "{doc}"')
    parts += ["" if INCLUDE.match(text) else text for text in body]
    if context:
        parts.append("}  // the fragment's function, closed by tests/compile/docs_snippets.py")
    parts += [f"}}  // namespace {target}", "#endif", ""]
    return "\n".join(parts)


def needed(lines):
    """The components the #includes among `lines` need, in order of first need."""
    needs = []
    for line in lines:
        include = INCLUDE.match(line)
        if include:
            for pattern, wanted in COMPONENTS:
                if pattern.search(include.group(1)):
                    needs += [c for c in wanted if c not in needs]
                    break
    return needs


def components(context, body):
    """(components the block and its context need, components to link, whether a "CMake:"
    comment names them): the components a "CMake:" comment of the block names (else those its
    #includes need), and those of the fragment's context, which the page says come from
    elsewhere."""
    around_lines = context[1] if context else []
    named = None
    for line in body:
        comment = CMAKE_COMMENT.search(line)
        if comment:
            named = (named or []) + COMPONENT_NAME.findall(comment.group(1))
    block = needed(body)
    around = needed(around_lines)
    links = sorted(set(named if named is not None else block) | set(around))
    return block + [c for c in around if c not in block], links, named


def write_if_changed(path, text):
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


# The shared sources (see above), by (needs libtorch, linked).
SHARED_SOURCES = {(False, False): "blocks.cpp", (False, True): "blocks_linked.cpp",
                  (True, False): "blocks_torch.cpp", (True, True): "blocks_torch_linked.cpp"}


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    docs, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    manifest = []
    shared = {source: [] for source in SHARED_SOURCES.values()}
    for name in sorted(os.listdir(docs)):
        if not name.endswith(".md"):
            continue
        doc = f"docs/{name}"
        for line, context, body in blocks(os.path.join(docs, name)):
            needs, links, named = components(context, body)
            cuda = any(c in needs + links for c in ("cuda", "nccl"))
            target = "docs_" + re.sub(r"[^A-Za-z0-9]", "_", name[:-3]) + f"_{line}"
            if named is not None and not cuda:
                # Linked with the others, this block would find what its comment leaves out in
                # their components: so the comment is checked here.
                missing = [c for c in needed(body) if c not in named]
                if missing:
                    sys.exit(f"docs_snippets: {doc}:{line}: the block's \"CMake:\" comment does "
                             f"not name tandem::{', tandem::'.join(missing)}, which its #includes "
                             "need")
            if cuda:
                source = target + ".cu"
                shared[source] = source_of(context, body)
            else:
                source = SHARED_SOURCES[("torch" in needs + links, named is not None)]
                shared[source].append(section_of(target, doc, line, context, body))
            manifest.append(
                f'tandem_doc_snippet(NAME {target} SOURCE "{os.path.join(out, source)}" '
                f'WHERE "{doc}:{line}" NEEDS {" ".join(needs)} LINKS {" ".join(links)}'
                f'{" LINKED" if named is not None else ""}{"" if cuda else " SHARED"})')
    written = set()
    for source, text in shared.items():
        if isinstance(text, list):
            if not text:
                continue
            linked = "linked" in source
            text = ("// The C++ blocks of docs/*.md, written by tests/compile/docs_snippets.py "
                    "(see there).\n\n" + "\n".join(text) +
                    ("\nint main() {}\n" if linked else ""))
        write_if_changed(os.path.join(out, source), text)
        written.add(source)
    for stale in os.listdir(out):
        if stale.endswith((".cpp", ".cu")) and stale not in written:
            os.remove(os.path.join(out, stale))
    write_if_changed(os.path.join(out, "manifest.cmake"), "\n".join(manifest) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
