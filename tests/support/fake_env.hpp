// A map standing in for the process environment, so tests never touch the real one.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "tandem/core/env.hpp"

namespace tandem::test {

class FakeEnv {
 public:
  FakeEnv(std::initializer_list<std::pair<const std::string, std::string>> vars) : vars_(vars) {}

  [[nodiscard]] EnvLookup lookup() const {
    return [this](std::string_view name) -> std::optional<std::string> {
      const auto it = vars_.find(std::string(name));
      if (it == vars_.end()) return std::nullopt;
      return it->second;
    };
  }

 private:
  std::map<std::string, std::string> vars_;
};

}  // namespace tandem::test
