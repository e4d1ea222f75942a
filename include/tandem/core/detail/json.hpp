// tandem/core/detail/json.hpp - just enough JSON for the files tandem writes and reads itself (the
// flight recorder's dumps, torchrun's error files): a string literal writer and a small parser into
// a tree, with bounded depth and size, that refuses anything malformed.
//   std::string text = "{\"rank\": " + std::to_string(r) + ", \"cause\": " + json_string(c) + "}";
//   auto doc = tandem::detail::parse_json(text);   // nullopt when malformed
//   if (doc) if (auto* rank = doc->find("rank")) use(rank->as_int());
// Needs: the standard library. Not a public header.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/core/env.hpp"

namespace tandem::detail {

/// `text` as a JSON string literal, quotes included.
inline std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (byte < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", byte);
          out += escaped;
        } else {
          out += c;  // UTF-8 passes through as it is
        }
    }
  }
  return out + "\"";
}

/// One JSON value. Numbers keep their text, so that 64-bit integers (nanosecond times) survive.
struct JsonValue {
  enum class Kind : std::uint8_t { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  bool flag = false;
  std::string text;  ///< a string's value, or a number's digits
  std::vector<JsonValue> items;
  std::vector<std::pair<std::string, JsonValue>> members;
  // Declared, not implied: clang (14, with libstdc++) works out an implied move's noexcept while
  // `pair<string, JsonValue>` is still incomplete, and rejects the class.
  JsonValue() = default;
  JsonValue(const JsonValue&) = default;
  JsonValue(JsonValue&&) noexcept = default;
  JsonValue& operator=(const JsonValue&) = default;
  JsonValue& operator=(JsonValue&&) noexcept = default;
  ~JsonValue() = default;

  /// The member `key` of an object (the first, should a key repeat); null otherwise.
  [[nodiscard]] const JsonValue* find(std::string_view key) const {
    if (kind != Kind::object) return nullptr;
    for (const auto& [name, value] : members) {
      if (name == key) return &value;
    }
    return nullptr;
  }
  /// A number that is a whole 64-bit integer; nullopt for anything else.
  [[nodiscard]] std::optional<std::int64_t> as_int() const {
    if (kind != Kind::number) return std::nullopt;
    return parse_int(text);
  }
  /// A string's value; nullopt for anything else.
  [[nodiscard]] std::optional<std::string> as_string() const {
    if (kind != Kind::string) return std::nullopt;
    return text;
  }
  /// The integer member `key`, or `otherwise` when it is missing or not an integer.
  [[nodiscard]] std::int64_t int_or(std::string_view key, std::int64_t otherwise) const {
    const JsonValue* value = find(key);
    const auto number = value ? value->as_int() : std::nullopt;
    return number ? *number : otherwise;
  }
  /// The string member `key`, or "" when it is missing or not a string.
  [[nodiscard]] std::string string_or(std::string_view key, std::string otherwise = {}) const {
    const JsonValue* value = find(key);
    return value && value->kind == Kind::string ? value->text : std::move(otherwise);
  }
};

/// A recursive-descent parser; every method returns false on malformed input.
class JsonParser {
 public:
  /// Nesting deeper than this is refused (a file of ours nests 4 levels).
  static constexpr int max_depth = 32;

  explicit JsonParser(std::string_view text) : text_(text) {}

  std::optional<JsonValue> document() {
    JsonValue value;
    if (!parse(value, 0)) return std::nullopt;
    skip_space();
    if (at_ != text_.size()) return std::nullopt;
    return value;
  }

 private:
  void skip_space() {
    while (at_ < text_.size() &&
           (text_[at_] == ' ' || text_[at_] == '\n' || text_[at_] == '\r' || text_[at_] == '\t')) {
      ++at_;
    }
  }
  [[nodiscard]] char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  bool consume(char c) {
    skip_space();
    if (peek() != c) return false;
    ++at_;
    return true;
  }
  bool literal(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }

  bool parse(JsonValue& value, int depth) {
    if (depth > max_depth) return false;
    skip_space();
    const char c = peek();
    if (c == '{') return object(value, depth);
    if (c == '[') return array(value, depth);
    if (c == '"') {
      value.kind = JsonValue::Kind::string;
      return string(value.text);
    }
    if (c == 't' || c == 'f') {
      value.kind = JsonValue::Kind::boolean;
      value.flag = c == 't';
      return literal(c == 't' ? "true" : "false");
    }
    if (c == 'n') return literal("null");
    return number(value);
  }

  bool object(JsonValue& value, int depth) {
    value.kind = JsonValue::Kind::object;
    ++at_;
    if (consume('}')) return true;
    for (;;) {
      std::string name;
      skip_space();
      if (!string(name) || !consume(':')) return false;
      JsonValue member;
      if (!parse(member, depth + 1)) return false;
      value.members.emplace_back(std::move(name), std::move(member));
      if (consume('}')) return true;
      if (!consume(',')) return false;
    }
  }

  bool array(JsonValue& value, int depth) {
    value.kind = JsonValue::Kind::array;
    ++at_;
    if (consume(']')) return true;
    for (;;) {
      JsonValue item;
      if (!parse(item, depth + 1)) return false;
      value.items.push_back(std::move(item));
      if (consume(']')) return true;
      if (!consume(',')) return false;
    }
  }

  bool number(JsonValue& value) {
    const auto start = at_;
    if (peek() == '-') ++at_;
    const auto digits = at_;
    while (at_ < text_.size() &&
           ((text_[at_] >= '0' && text_[at_] <= '9') || text_[at_] == '.' || text_[at_] == 'e' ||
            text_[at_] == 'E' || text_[at_] == '+' || (text_[at_] == '-' && at_ > digits))) {
      ++at_;
    }
    if (at_ == digits || text_[digits] < '0' || text_[digits] > '9') return false;
    value.kind = JsonValue::Kind::number;
    value.text = std::string(text_.substr(start, at_ - start));
    return true;
  }

  std::optional<unsigned> hex4() {
    if (text_.size() - at_ < 4) return std::nullopt;
    unsigned value = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[at_++];
      value <<= 4;
      if (c >= '0' && c <= '9') {
        value |= static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        value |= static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        value |= static_cast<unsigned>(c - 'A' + 10);
      } else {
        return std::nullopt;
      }
    }
    return value;
  }

  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }

  bool string(std::string& out) {
    if (peek() != '"') return false;
    ++at_;
    while (at_ < text_.size()) {
      const char c = text_[at_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;  // raw control characters
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= text_.size()) return false;
      switch (const char escaped = text_[at_++]) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case '"':
        case '\\':
        case '/':
          out += escaped;
          break;
        case 'u': {
          auto code = hex4();
          if (!code) return false;
          // A surrogate pair (how Python's json writes characters beyond the BMP).
          if (*code >= 0xD800 && *code < 0xDC00 && text_.substr(at_, 2) == "\\u") {
            at_ += 2;
            const auto low = hex4();
            if (!low || *low < 0xDC00 || *low >= 0xE000) return false;
            code = 0x10000 + ((*code - 0xD800) << 10) + (*low - 0xDC00);
          }
          append_utf8(out, *code);
          break;
        }
        default:
          return false;
      }
    }
    return false;
  }

  std::string_view text_;
  std::size_t at_ = 0;
};

/// The tree of `text`; nullopt when it is not one whole JSON value (or nests too deep).
inline std::optional<JsonValue> parse_json(std::string_view text) {
  return JsonParser(text).document();
}

}  // namespace tandem::detail
