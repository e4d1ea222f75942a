#!/bin/sh
# The compiler launcher of the docs' blocks that are compiled but not linked (docs_snippets.cmake):
#   syntax_only.sh COMPILER ARG...
# runs the compiler with -fsyntax-only (every template the block uses is still instantiated and
# checked; no code is generated) and, when it succeeds, leaves an empty file where the build
# expects the object, so that the build tool sees the block as built until its source changes.
set -eu
"$@" -fsyntax-only
object=
previous=
for arg in "$@"; do
  if [ "$previous" = "-o" ]; then object=$arg; fi
  previous=$arg
done
if [ -n "$object" ]; then : >"$object"; fi
