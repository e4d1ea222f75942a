// tandem/io/detail/state_fields.hpp - the checked reads of a training state's fields
// (TrainingState's): integers in their type's range, finite numbers, GradScaler values, tensors
// of the model's shape, names with or without DDP's "module.".
// Needs: nlohmann-json.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ranges>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/io/safetensors.hpp"

namespace tandem::detail {
// An integer field of the metadata, as type I: a JSON integer in I's range, else an Error naming
// the field (nlohmann's get<I> would cast a float, with undefined behaviour out of range, and
// wrap a negative number into an unsigned type).
template <class I>
requires std::is_integral_v<I> I json_integer(const nlohmann::json& value, std::string_view what) {
  if (value.is_number_unsigned()) {
    const auto v = value.template get<std::uint64_t>();
    if (std::in_range<I>(v)) return static_cast<I>(v);
  } else if (value.is_number_integer()) {
    const auto v = value.template get<std::int64_t>();
    if (std::in_range<I>(v)) return static_cast<I>(v);
  } else {
    throw Error("load_checkpoint",
                "'" + std::string(what) + "' is " + value.dump() + ", not an integer");
  }
  throw Error("load_checkpoint",
              "'" + std::string(what) + "' is " + value.dump() + ", out of range for its type");
}

// A list of integers of the metadata (see json_integer).
template <class I>
std::vector<I> json_integers(const nlohmann::json& value, std::string_view what) {
  if (!value.is_array()) {
    throw Error("load_checkpoint", "'" + std::string(what) + "' is not a list of integers");
  }
  std::vector<I> out;
  out.reserve(value.size());
  for (const auto& item : value) out.push_back(json_integer<I>(item, what));
  return out;
}

// A whole decimal number of the text `digits` (no sign, no spaces, nothing after it) that fits
// I; nullopt otherwise.
template <class I>
std::optional<I> whole_number(std::string_view digits) {
  I value{};
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || digits.front() == '-' || error != std::errc() ||
      end != digits.data() + digits.size()) {
    return std::nullopt;
  }
  return value;
}

// A number field of the metadata: a JSON number, finite (nlohmann's get<double> would take
// `true` as 1), else an Error naming the field.
inline double json_number(const nlohmann::json& value, std::string_view what) {
  if (!value.is_number() || !std::isfinite(value.get<double>())) {
    throw Error("load_checkpoint",
                "'" + std::string(what) + "' is " + value.dump() + ", not a finite number");
  }
  return value.get<double>();
}

// A list of numbers of the metadata (see json_number).
inline std::vector<double> json_number_list(const nlohmann::json& value, std::string_view what) {
  if (!value.is_array()) {
    throw Error("load_checkpoint", "'" + std::string(what) + "' is not a list of numbers");
  }
  std::vector<double> out;
  for (const auto& item : value) out.push_back(json_number(item, what));
  return out;
}

// An object of named numbers of the metadata (optimizer options, GradScaler state; see
// json_number).
inline std::map<std::string, double> json_number_map(const nlohmann::json& value,
                                                     std::string_view what) {
  if (!value.is_object()) {
    throw Error("load_checkpoint", "'" + std::string(what) + "' is not an object of numbers");
  }
  std::map<std::string, double> out;
  for (const auto& [key, item] : value.items()) {
    out[key] = json_number(item, std::string(what) + "." + key);
  }
  return out;
}

// What a GradScaler's state must hold to be restored: positive finite scale, growth factor above
// 1, backoff factor in (0, 1), a positive whole growth interval and a whole non-negative tracker
// (GradScaler converts the last two to integers, undefined behaviour out of their range).
inline void check_scaler_state(const std::map<std::string, double>& state, const std::string& key) {
  auto check = [&](const char* name, bool ok, const char* must) {
    const auto found = state.find(name);
    if (found == state.end() || ok) return;
    throw Error("load_checkpoint", "'" + key + "." + name + "' is " +
                                       nlohmann::json(found->second).dump() + "; it must be " +
                                       must);
  };
  auto value = [&](const char* name) {
    const auto found = state.find(name);
    return found == state.end() ? 1.5 : found->second;
  };
  auto whole = [](double v, double high) { return v == std::floor(v) && v >= 0 && v <= high; };
  check("scale", value("scale") > 0, "positive");
  check("growth_factor", value("growth_factor") > 1, "above 1");
  check("backoff_factor", value("backoff_factor") > 0 && value("backoff_factor") < 1,
        "between 0 and 1");
  check("growth_interval", whole(value("growth_interval"), 1e18) && value("growth_interval") >= 1,
        "a whole number of at least 1");
  check("_growth_tracker",
        whole(value("_growth_tracker"), std::numeric_limits<std::int32_t>::max()),
        "a whole number from 0 to 2^31 - 1");
}

// The shape a tensor of `shape` is stored under: the same, or [numel] for a 0-d one (what
// SafetensorsWriter::add makes of an empty shape).
template <class Shape>
std::vector<std::int64_t> stored_shape(const Shape& shape, std::size_t numel) {
  std::vector<std::int64_t> out(shape.begin(), shape.end());
  if (out.empty()) out.push_back(static_cast<std::int64_t>(numel));
  return out;
}

inline std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Reads tensor `name` of `in` into `out`, whose shape must be the file's (read_into checks the
// dtype and the element count; a transposed [3, 4] for a [4, 3] parameter has the right count).
template <class Out, class Shape>
void read_shaped(const SafetensorsFile& in, const std::string& name, Out&& out,
                 const Shape& shape) {
  const auto expected = stored_shape(shape, std::ranges::size(out));
  const auto& entry = in.entry(name);
  if (entry.shape != expected &&
      !(expected.size() == 1 && entry.shape.empty() && expected[0] == 1)) {
    throw Error("load_checkpoint " + in.name(), "tensor '" + name + "' has the shape " +
                                                    shape_text(entry.shape) + " in the file and " +
                                                    shape_text(expected) + " in the model");
  }
  in.read_into(name, std::forward<Out>(out));
}

// A name in the file for `name`: the same, or the same with or without "module." (what
// DistributedDataParallel adds in PyTorch), whichever the file has.
inline std::string name_in_file(const SafetensorsFile& file, const std::string& name) {
  if (file.contains(name)) return name;
  constexpr std::string_view module = "module.";
  if (name.starts_with(module) && file.contains(name.substr(module.size()))) {
    return name.substr(module.size());
  }
  if (file.contains(std::string(module) + name)) return std::string(module) + name;
  return name;  // entry() names it in its error
}
}  // namespace tandem::detail
