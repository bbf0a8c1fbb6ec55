// GoogleTest's header, precompiled once per build (Makefile: TEST_PCH) and included first in every
// test source: parsing it took about a third of each test file's compile.
#include <gtest/gtest.h>
