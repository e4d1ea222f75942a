// tandem/comm/agree.hpp - tandem::agree: the check, at start, that every rank runs with the same
// configuration (seed, learning rate, batch size, data set, ...). One rank started with another
// --lr would otherwise train a diverging replica without a word.
//   tandem::agree(comm, {{"--seed", seed}, {"--lr", lr}, {"--batch", batch}, {"--data", dir}});
//   // on every rank, when one differs:
//   // tandem: rank 0: agree: --lr differs: ranks 0, 1, 3 have 0.1; rank 2 has 0.2
// Values: integers, bool, floating point (compared exactly: bit for bit), strings and paths
// (compared as written). Cheap: one all_gather of a 64-bit fingerprint; the values themselves
// travel only when fingerprints differ, to name them. Collective: every rank calls it.
// Needs: a Communicator (any backend; a device communicator's values travel through a small
// device buffer).
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/host_values.hpp"
#include "tandem/core/detail/disagreement.hpp"
#include "tandem/core/error.hpp"

namespace tandem {

/// One value that must be the same on every rank, under a name that says where it came from
/// ("--lr", "seed"): its kind and its exact text.
class Setting {
 public:
  /// What a value is; values of different kinds never agree, even when they read the same.
  enum class Kind : std::uint8_t { integer, boolean, floating_point, text };

  /// An integer (signed or unsigned; not a character type).
  template <std::integral T>
  requires(!std::same_as<T, bool> && !std::same_as<T, char> && !std::same_as<T, wchar_t> &&
           !std::same_as<T, char8_t> && !std::same_as<T, char16_t> && !std::same_as<T, char32_t>)
      Setting(std::string name, T value)
      : name_(std::move(name)), kind_(Kind::integer) {
    text_ = std::to_string(value);
  }
  /// true or false.
  Setting(std::string name, bool value)
      : name_(std::move(name)), kind_(Kind::boolean), text_(value ? "true" : "false") {}
  /// A floating-point value, compared bit for bit: its shortest exact text (0.1, 3e-05, -0, nan).
  template <std::floating_point T>
  Setting(std::string name, T value) : name_(std::move(name)), kind_(Kind::floating_point) {
    char buffer[64];
    const auto [end, error] = std::to_chars(buffer, buffer + sizeof buffer, value);
    text_ = error == std::errc{} ? std::string(buffer, end) : std::string("?");
    if (std::signbit(value) && text_.front() != '-') text_.insert(0, "-");  // -nan
  }
  /// A string, compared as written.
  Setting(std::string name, std::string_view value)
      : name_(std::move(name)), kind_(Kind::text), text_(value) {}
  /// A string, compared as written.
  Setting(std::string name, const std::string& value)
      : Setting(std::move(name), std::string_view(value)) {}
  /// A string, compared as written.
  Setting(std::string name, const char* value)
      : Setting(std::move(name), std::string_view(value ? value : "")) {}
  /// A path, compared as written ("data" and "./data" differ: give ranks the same spelling).
  Setting(std::string name, const std::filesystem::path& value)
      : Setting(std::move(name), std::string_view(value.native())) {}

  /// A value of `kind` already in its exact text (how agree() rebuilds other ranks' settings).
  Setting(std::string name, Kind kind, std::string text)
      : name_(std::move(name)), kind_(kind), text_(std::move(text)) {}

  /// The name, as given.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The kind of value.
  [[nodiscard]] Kind kind() const noexcept { return kind_; }
  /// The value's exact text (without quotes).
  [[nodiscard]] const std::string& text() const noexcept { return text_; }
  /// The value as a message shows it: text in quotes, numbers as they are.
  [[nodiscard]] std::string shown() const {
    return kind_ == Kind::text ? "\"" + text_ + "\"" : text_;
  }

 private:
  std::string name_;
  Kind kind_;
  std::string text_;
};

namespace detail::agreement {

/// The kind's name, for a message about values of different kinds.
inline const char* kind_name(Setting::Kind kind) {
  switch (kind) {
    case Setting::Kind::integer:
      return "an integer";
    case Setting::Kind::boolean:
      return "a bool";
    case Setting::Kind::floating_point:
      return "a floating-point value";
    case Setting::Kind::text:
      return "a string";
  }
  return "a value";
}

/// Appends a length-prefixed field (8 bytes of length, little end first, then the bytes).
inline void put(std::string& out, std::string_view field) {
  auto length = static_cast<std::uint64_t>(field.size());
  for (int i = 0; i < 8; ++i, length >>= 8) out.push_back(static_cast<char>(length & 0xff));
  out.append(field);
}

/// Reads a field written by put() at `at`; false when the bytes end first.
inline bool take(std::string_view in, std::size_t& at, std::string& field) {
  if (in.size() - at < 8) return false;
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<unsigned char>(in[at + i]);
  at += 8;
  if (in.size() - at < length) return false;
  field.assign(in.substr(at, length));
  at += length;
  return true;
}

/// Every setting as name, kind, text: what the fingerprint hashes and what travels on a mismatch.
inline std::string encode(std::span<const Setting> settings) {
  std::string out;
  for (const auto& setting : settings) {
    put(out, setting.name());
    put(out, std::string(1, static_cast<char>(setting.kind())));
    put(out, setting.text());
  }
  return out;
}

/// The settings encode() wrote (a rank's own, so well formed; a short tail is dropped).
inline std::vector<Setting> decode(std::string_view bytes) {
  std::vector<Setting> settings;
  std::size_t at = 0;
  std::string name, kind, text;
  while (at < bytes.size() && take(bytes, at, name) && take(bytes, at, kind) &&
         take(bytes, at, text) && kind.size() == 1) {
    settings.emplace_back(name, static_cast<Setting::Kind>(static_cast<unsigned char>(kind[0])),
                          text);
  }
  return settings;
}

/// The message naming every setting in which ranks differ (every_rank[r] is rank r's list).
inline std::string describe(const std::vector<std::vector<Setting>>& every_rank) {
  std::vector<std::string> names;  // in the order ranks list them, rank 0's first
  for (const auto& settings : every_rank) {
    for (const auto& setting : settings) {
      if (std::find(names.begin(), names.end(), setting.name()) == names.end()) {
        names.push_back(setting.name());
      }
    }
  }
  std::string text;
  for (const auto& name : names) {
    std::vector<const Setting*> seen;  // rank r's setting of that name, or null
    for (const auto& settings : every_rank) {
      const auto found = std::find_if(settings.begin(), settings.end(),
                                      [&](const Setting& s) { return s.name() == name; });
      seen.push_back(found == settings.end() ? nullptr : &*found);
    }
    bool kinds_differ = false;
    for (const auto* s : seen) kinds_differ |= s && seen[0] && s->kind() != seen[0]->kind();
    std::vector<std::string> values;
    for (const auto* s : seen) {
      values.push_back(!s             ? std::string("no such setting")
                       : kinds_differ ? s->shown() + " (" + kind_name(s->kind()) + ")"
                                      : s->shown());
    }
    const std::string groups = disagreement(values, [](const std::string& v) { return v; });
    if (groups.empty()) continue;
    if (!text.empty()) text += ". ";
    text += name + " differs: " +
            describe_groups(
                values, [](const std::string& v) { return v; }, " has ", " have ");
  }
  return text;
}

}  // namespace detail::agreement

/// Collective: returns when every rank of `comm` holds the same `settings` (names, kinds, values,
/// in the same order); otherwise an Error on every rank naming each setting that differs, the
/// ranks and their values: "--lr differs: ranks 0, 1, 3 have 0.1; rank 2 has 0.2". Give it the
/// values that must agree (seed, rates, batch size, schedule, data set, model shape, resume
/// directory), not per-rank ones (a log file, the rank itself).
template <Communicator Comm>
void agree(Comm& comm, std::span<const Setting> settings) {
  if (comm.size() == 1) return;
  const std::string mine = detail::agreement::encode(settings);
  const auto ranks = static_cast<std::size_t>(comm.size());

  const std::int64_t fingerprint[1] = {static_cast<std::int64_t>(detail::fnv1a(mine))};
  std::vector<std::int64_t> fingerprints(ranks);
  detail::host_all_gather(comm, std::span<const std::int64_t>(fingerprint),
                          std::span<std::int64_t>(fingerprints));
  bool same = true;
  for (const auto f : fingerprints) same = same && f == fingerprints[0];
  if (same) return;

  // Every rank's settings: the lengths, then the bytes padded to the longest.
  const std::int64_t length[1] = {static_cast<std::int64_t>(mine.size())};
  std::vector<std::int64_t> lengths(ranks);
  detail::host_all_gather(comm, std::span<const std::int64_t>(length),
                          std::span<std::int64_t>(lengths));
  std::size_t longest = 0;
  for (const auto l : lengths) longest = std::max(longest, static_cast<std::size_t>(l));
  std::vector<std::uint8_t> padded(longest, 0);
  std::memcpy(padded.data(), mine.data(), mine.size());
  std::vector<std::uint8_t> all(longest * ranks);
  detail::host_all_gather(comm, std::span<const std::uint8_t>(padded),
                          std::span<std::uint8_t>(all));
  std::vector<std::vector<Setting>> every_rank;
  for (std::size_t r = 0; r < ranks; ++r) {
    const auto* first = reinterpret_cast<const char*>(all.data() + r * longest);
    every_rank.push_back(detail::agreement::decode(
        std::string_view(first, std::min(longest, static_cast<std::size_t>(lengths[r])))));
  }
  std::string cause = detail::agreement::describe(every_rank);
  if (cause.empty()) {  // the same values in another order
    cause = "the ranks list the same settings in different orders; list them in one order";
  }
  throw Error(comm.rank(), "agree",
              cause +
                  " (every rank must run with the same configuration: start them with the "
                  "same flags and files)");
}

/// agree() over a braced list: `tandem::agree(comm, {{"--seed", seed}, {"--lr", lr}})`.
template <Communicator Comm>
void agree(Comm& comm, std::initializer_list<Setting> settings) {
  agree(comm, std::span<const Setting>(settings.begin(), settings.size()));
}

}  // namespace tandem
