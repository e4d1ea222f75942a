// The host-only part of NcclComm (tandem/comm/nccl/detail/nccl_support.hpp), built by the plain C++
// compiler and run without a GPU: element types and reduce ops as NCCL's enums, the unique id's
// text form for the store, NCCL's error texts and version numbers.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "tandem/comm/nccl/detail/nccl_support.hpp"

namespace nccl = tandem::detail::nccl;

TEST_CASE("every element type travels as NCCL's type of the same width, half and bfloat16 too") {
  static_assert(nccl::data_type<float>() == ncclFloat32);
  static_assert(nccl::data_type<double>() == ncclFloat64);
  static_assert(nccl::data_type<tandem::half>() == ncclFloat16);
  static_assert(nccl::data_type<tandem::bfloat16>() == ncclBfloat16);
  static_assert(nccl::data_type<std::int32_t>() == ncclInt32);
  static_assert(nccl::data_type<std::int64_t>() == ncclInt64);
  static_assert(nccl::data_type<std::uint8_t>() == ncclUint8);
  CHECK(nccl::data_type<tandem::half>() != nccl::data_type<tandem::bfloat16>());
}

TEST_CASE("reduce ops map to NCCL's built-in ops, avg to ncclAvg") {
  CHECK(nccl::reduce_op(tandem::ReduceOp::sum) == ncclSum);
  CHECK(nccl::reduce_op(tandem::ReduceOp::avg) == ncclAvg);
  CHECK(nccl::reduce_op(tandem::ReduceOp::prod) == ncclProd);
  CHECK(nccl::reduce_op(tandem::ReduceOp::min) == ncclMin);
  CHECK(nccl::reduce_op(tandem::ReduceOp::max) == ncclMax);
}

TEST_CASE("a unique id survives its text form byte for byte") {
  ncclUniqueId id{};
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) {
    id.internal[i] = static_cast<char>(static_cast<unsigned char>(i * 37 + 11));
  }
  const std::string text = nccl::encode_unique_id(id);
  CHECK(text.size() == 2 * NCCL_UNIQUE_ID_BYTES);
  CHECK(text.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(text.substr(0, 4) == "0b30");  // bytes 11 and 48
  const ncclUniqueId back = nccl::decode_unique_id(text, 2);
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) CHECK(back.internal[i] == id.internal[i]);
}

TEST_CASE("a malformed unique id is an Error naming the rank, not a wrong communicator") {
  ncclUniqueId id{};
  std::string text = nccl::encode_unique_id(id);
  try {
    (void)nccl::decode_unique_id(text.substr(1), 3);
    FAIL("a short id was accepted");
  } catch (const tandem::Error& e) {
    CHECK(e.rank() == 3);
    CHECK(std::string(e.what()).find("255 characters, expected 256") != std::string::npos);
  }
  text[7] = 'g';
  CHECK_THROWS_WITH_AS((void)nccl::decode_unique_id(text, 1),
                       doctest::Contains("character 6 is not a hex digit"), tandem::Error);
}

TEST_CASE("NCCL's errors read as their names and NCCL's own explanation") {
  const std::string text = nccl::error_text(ncclSystemError);
  CHECK(text.rfind("ncclSystemError (", 0) == 0);
  CHECK(text.find(ncclGetErrorString(ncclSystemError)) != std::string::npos);
  CHECK(nccl::error_text(ncclRemoteError).rfind("ncclRemoteError", 0) == 0);
  try {
    (void)nccl::check(ncclInvalidArgument, 4, "all_reduce (sequence number 9)");
    FAIL("no error");
  } catch (const tandem::Error& e) {
    CHECK(e.rank() == 4);
    CHECK(e.operation() == "all_reduce (sequence number 9)");
    CHECK(e.cause().rfind("ncclInvalidArgument", 0) == 0);
  }
  CHECK(nccl::check(ncclInProgress, 0, "x") == ncclInProgress);
  CHECK_THROWS_AS((void)nccl::check(ncclInProgress, 0, "x", nullptr, false), tandem::Error);
  CHECK(nccl::describe_operation("broadcast", 12) == "broadcast (sequence number 12)");
}

TEST_CASE("versions: both of NCCL's encodings, and the library this test loaded") {
  CHECK(nccl::version_text(2708) == "2.7.8");
  CHECK(nccl::version_text(22809) == "2.28.9");
  CHECK(nccl::version_text(21903) == "2.19.3");
  const int loaded = nccl::runtime_version();  // libnccl loads without a GPU
  CHECK(loaded >= 21800);
  MESSAGE("NCCL header " << nccl::version_text(NCCL_VERSION_CODE) << ", library "
                         << nccl::version_text(loaded));
  CHECK(nccl::native_rooted_collectives == (NCCL_VERSION_CODE >= 22800));
}

TEST_CASE("split's colour: no_color is NCCL_SPLIT_NOCOLOR, any other colour is itself") {
  CHECK(nccl::split_color(tandem::no_color) == NCCL_SPLIT_NOCOLOR);
  CHECK(nccl::split_color(0) == 0);
  CHECK(nccl::split_color(13) == 13);
  static_assert(nccl::split_color(7) == 7);
}
