// tests/support/golden.hpp - reads the golden files that tests/reference/make_golden.py writes
// with PyTorch, so tests compare tandem against numbers PyTorch itself produced.
//   tandem::test::Golden golden("sgd.txt");          // looked up in tests/reference/
//   std::vector<double> lr = golden.values("lr/cosine");
// Format, one record per line: `key count v0 v1 ...`; values are Python float.hex() (exact) or
// decimal; '#' starts a comment line. Keys are unique within a file.
#pragma once

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef TANDEM_REFERENCE_DIR
#error "tests that read golden data need TANDEM_REFERENCE_DIR (tests/CMakeLists.txt defines it)"
#endif

namespace tandem::test {

class Golden {
 public:
  explicit Golden(const std::string& file) : path_(std::string(TANDEM_REFERENCE_DIR) + "/" + file) {
    std::ifstream in(path_);
    if (!in) throw std::runtime_error("golden file " + path_ + " is missing; run make_golden.py");
    std::string line;
    int line_number = 0;
    while (std::getline(in, line)) {
      ++line_number;
      if (line.empty() || line[0] == '#') continue;
      std::istringstream fields(line);
      std::string key;
      std::size_t count = 0;
      if (!(fields >> key >> count)) fail(line_number, "expected `key count values...`");
      std::vector<double> values;
      values.reserve(count);
      std::string token;
      while (fields >> token) {
        char* end = nullptr;
        double value = std::strtod(token.c_str(), &end);  // reads hex floats, inf and nan too
        if (end != token.c_str() + token.size()) fail(line_number, "bad number '" + token + "'");
        values.push_back(value);
      }
      if (values.size() != count) {
        fail(line_number, "key " + key + " declares " + std::to_string(count) + " values, has " +
                              std::to_string(values.size()));
      }
      if (!records_.emplace(key, std::move(values)).second) fail(line_number, "duplicate " + key);
    }
  }

  [[nodiscard]] bool contains(const std::string& key) const { return records_.count(key) != 0; }

  [[nodiscard]] const std::vector<double>& values(const std::string& key) const {
    auto found = records_.find(key);
    if (found == records_.end()) throw std::runtime_error(path_ + " has no key " + key);
    return found->second;
  }

  [[nodiscard]] double value(const std::string& key) const {
    const auto& all = values(key);
    if (all.size() != 1) throw std::runtime_error(path_ + ": " + key + " is not a scalar");
    return all.front();
  }

  /// The keys in sorted order, for tests that iterate over every recorded case.
  [[nodiscard]] std::vector<std::string> keys() const {
    std::vector<std::string> all;
    for (const auto& [key, values] : records_) all.push_back(key);
    return all;
  }

 private:
  [[noreturn]] void fail(int line_number, const std::string& cause) const {
    throw std::runtime_error(path_ + ":" + std::to_string(line_number) + ": " + cause);
  }

  std::string path_;
  std::map<std::string, std::vector<double>> records_;
};

}  // namespace tandem::test
