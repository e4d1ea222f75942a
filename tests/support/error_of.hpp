// tests/support/error_of.hpp - what a test asks of a tandem::Error: its message, and whether the
// message contains a phrase.
//   CHECK(tandem::test::contains(tandem::test::error_of([&] { store.get("k"); }), "timed out"));
// Needs: doctest (the overload that names the operation asserts), tandem/core/error.hpp.
#pragma once

#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <utility>

#include "tandem/core/error.hpp"

namespace tandem::test {

/// What error_of returns when nothing was thrown: no tandem message contains it.
inline constexpr std::string_view no_error = "(no tandem::Error)";

/// Calls fn() and returns the tandem::Error's message, or no_error when nothing was thrown.
/// Other exceptions pass through.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const tandem::Error& error) {
    return error.what();
  }
  return std::string(no_error);
}

/// The same, for a call that must throw a tandem::Error naming `operation` (doctest checks
/// both; the message is returned for further checks).
template <class Fn>
std::string error_of(Fn&& fn, const std::string& operation) {
  try {
    std::forward<Fn>(fn)();
  } catch (const tandem::Error& error) {
    CHECK(error.operation() == operation);
    return error.what();
  }
  FAIL("no tandem::Error thrown by " << operation);
  return {};
}

/// Whether `text` contains `part`.
inline bool contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

}  // namespace tandem::test
