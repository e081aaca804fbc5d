// dgr_monocypher.cpp - Monocypher 4.0.3 (the native links' sealing: dgr_link.cpp), compiled into
// the module as C++ with the module's own flags. monocypher.c is the pinned file itself, fetched
// and verified by cffi_build.py from native/monocypher.manifest.json into .workspace/ (never
// committed); Monocypher is portable C99 that also compiles as C++.

#include "monocypher.c"
