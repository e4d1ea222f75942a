// The translation unit the tests' shared precompiled header is built with (tests/CMakeLists.txt:
// tandem_test_pch). It has no code of its own.
