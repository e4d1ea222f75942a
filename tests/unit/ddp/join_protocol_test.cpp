// tandem::Join's status words and the verdict every rank draws from them
// (ddp/detail/join_protocol.hpp), without a communicator: what a step decides for each mix of
// ranks with data, out of data, out under throw_on_early_termination, and gone.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "tandem/ddp/detail/join_protocol.hpp"

namespace {

using tandem::detail::join::decode;
using tandem::detail::join::encode;
using tandem::detail::join::Event;
using tandem::detail::join::Journals;
using tandem::detail::join::judge;
using tandem::detail::join::State;
using tandem::detail::join::Status;

Status active(std::uint32_t pattern = 1) {
  return {State::active, false, false, 7, pattern};
}
Status joined(std::uint32_t widest = 1, bool shadowed = true, bool has_journal = true) {
  return {State::joined, shadowed, has_journal, 7, widest};
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("Join status words round-trip, and stay non-negative") {
  for (const Status s : {active(0), active(0xFFFFFFFFu), joined(5, false, true),
                         Status{State::left_with_exception, true, true, 0xFFFF, 0x80000001u}}) {
    CHECK(encode(s) >= 0);
    CHECK(decode(encode(s)) == s);
  }
}

TEST_CASE("Join verdicts: the root, the ranks with data, the end") {
  auto v = judge({joined(), active(), joined(), active()}, 4);
  CHECK(v.error.empty());
  CHECK_FALSE(v.done);
  CHECK(v.root == 1);
  CHECK(v.active == 2);
  CHECK(v.pattern == 1u);
  // Everyone out of data: the final model comes from the lowest of the last to join.
  v = judge({joined(1, true), joined(1, false), joined(1, false)}, 9);
  CHECK(v.done);
  CHECK(v.root == 1);
  v = judge(
      {Status{State::exhausted, false, true, 7, 0}, Status{State::exhausted, false, true, 7, 0}},
      2);
  CHECK(v.done);
  CHECK(v.root == 0);
}

TEST_CASE("Join verdicts: every misuse is an Error with its words") {
  CHECK(has(judge({active(), Status{State::active, false, false, 8, 1}}, 1).error,
            "different joinables or options"));
  const auto left = judge({active(), Status{State::left, false, false, 7, 0},
                           Status{State::left_with_exception, false, false, 7, 0},
                           Status{State::left, false, false, 7, 0}},
                          3)
                        .error;
  CHECK(has(left, "rank 2 left the Join because of an exception"));
  CHECK(has(left, "ranks 1, 3 destroyed their Joins without calling finish()"));
  CHECK(has(left, "(step 3 of the Join)"));
  CHECK(
      has(judge({Status{State::exhausted, false, true, 7, 0}, active(), active()}, 5).error,
          "throw_on_early_termination: rank 0 ran out of inputs while ranks 1, 2 still had data"));
  CHECK(has(judge({active(1), active(0), active(1)}, 2).error,
            "ranks 0, 2: DistributedDataParallel #0; rank 1: no DistributedDataParallel"));
  // A rank out of data must have a journal covering the step the others announce.
  CHECK(judge({active(0b11), joined(0b11)}, 6).error.empty());
  CHECK(judge({active(0b01), joined(0b11)}, 6).error.empty());
  CHECK(has(judge({active(0b11), joined(0b01)}, 6).error,
            "rank 1 ran out of data before running a step like this one (DistributedDataParallel "
            "#0, #1 synchronising"));
  CHECK(has(judge({active(0), joined(0, false, false)}, 1).error, "rank 1 ran out of data"));
}

TEST_CASE("Join journals: the first step of a kind is kept, later ones compared with it") {
  Journals journals;
  CHECK_FALSE(journals.any());
  const std::vector<Event> sync{{0, 0, 0}, {0, 1, 0}, {1, 0, 0}, {0, 1, 1}, {0, 2, 0}};
  const std::vector<Event> accumulate{{0, 0, 0}, {1, 0, 0}};
  CHECK(journals.keep(0, accumulate) == Journals::npos);
  CHECK(journals.widest() == 0u);
  CHECK(journals.keep(1, sync) == Journals::npos);
  CHECK(journals.widest() == 1u);
  CHECK(journals.keep(1, sync) == Journals::npos);
  auto reordered = sync;
  std::swap(reordered[1], reordered[2]);
  CHECK(journals.keep(1, reordered) == 1);
  CHECK(journals.keep(1, {sync.begin(), sync.end() - 1}) == 4);
  CHECK(journals.keep(0, accumulate) == Journals::npos);
  REQUIRE(journals.find(0) != nullptr);
  CHECK(*journals.find(0) == accumulate);
  CHECK(journals.find(2) == nullptr);
}
