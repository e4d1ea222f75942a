// tandem/comm/nccl/detail/nccl_support.hpp - what NcclComm needs from NCCL that runs on the host
// alone: element types and reduce ops as NCCL's enums, ncclUniqueId as text for a Store, NCCL's
// errors as readable text, and the version checks. No kernels and no tandem/cuda headers, so a
// plain C++ compiler builds it (and its unit test needs no GPU).
//   const ncclDataType_t type = tandem::detail::nccl::data_type<tandem::half>();
// Needs: nccl.h (NCCL 2.18 or newer; link tandem::nccl). Not a public header: nccl.hpp uses it.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <type_traits>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"

#if NCCL_VERSION_CODE < 21800
#error "tandem::NcclComm needs NCCL 2.18 or newer (ncclCommSplit, nonblocking communicators)"
#endif

namespace tandem::detail::nccl {

/// NCCL's type for element type E (all seven of tandem's types have one: half and bfloat16
/// travel as themselves, never widened).
template <class E>
constexpr ncclDataType_t data_type() noexcept {
  if constexpr (std::is_same_v<E, float>) {
    return ncclFloat32;
  } else if constexpr (std::is_same_v<E, double>) {
    return ncclFloat64;
  } else if constexpr (std::is_same_v<E, half>) {
    return ncclFloat16;
  } else if constexpr (std::is_same_v<E, bfloat16>) {
    return ncclBfloat16;
  } else if constexpr (std::is_same_v<E, std::int32_t>) {
    return ncclInt32;
  } else if constexpr (std::is_same_v<E, std::int64_t>) {
    return ncclInt64;
  } else {
    static_assert(std::is_same_v<E, std::uint8_t>, "tandem: NCCL has no type for this element");
    return ncclUint8;
  }
}

/// NCCL's built-in reduction for op; avg is ncclAvg (NCCL divides by the group size itself).
constexpr ncclRedOp_t reduce_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::prod:
      return ncclProd;
    case ReduceOp::min:
      return ncclMin;
    case ReduceOp::max:
      return ncclMax;
  }
  return ncclSum;
}

/// calls() between ncclGroupStart and ncclGroupEnd: the grouped send/recv of NCCL versions
/// without gather, scatter and all-to-all of their own. The first failure is returned.
template <class Calls>
ncclResult_t grouped_calls(Calls calls) {
  ncclResult_t state = ncclGroupStart();
  if (state != ncclSuccess) return state;
  const ncclResult_t inner = calls();
  state = ncclGroupEnd();
  return inner != ncclSuccess ? inner : state;
}

/// "ncclSystemError (unhandled system error ...)" plus NCCL's own last message where it has one.
inline std::string error_text(ncclResult_t result, ncclComm_t comm = nullptr) {
  const char* names[] = {"ncclSuccess",       "ncclUnhandledCudaError", "ncclSystemError",
                         "ncclInternalError", "ncclInvalidArgument",    "ncclInvalidUsage",
                         "ncclRemoteError",   "ncclInProgress"};
  const auto index = static_cast<std::size_t>(result);
  std::string text =
      index < std::size(names) ? names[index] : "ncclResult " + std::to_string(index);
  text += std::string(" (") + ncclGetErrorString(result) + ")";
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += ": " + std::string(last);
  return text;
}

/// Throws tandem::Error(rank, operation, NCCL's text) unless result is ncclSuccess or, where
/// `in_progress_ok`, ncclInProgress (a nonblocking communicator still working).
inline ncclResult_t check(ncclResult_t result, int rank, const std::string& operation,
                          ncclComm_t comm = nullptr, bool in_progress_ok = true) {
  if (result == ncclSuccess || (in_progress_ok && result == ncclInProgress)) return result;
  throw Error(rank, operation, error_text(result, comm));
}

// --- ncclUniqueId as text: how rank 0 hands it to the others through a tandem Store
// ---------------

inline std::string encode_unique_id(const ncclUniqueId& id) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string text;
  text.reserve(2 * NCCL_UNIQUE_ID_BYTES);
  for (char c : id.internal) {
    const auto byte = static_cast<unsigned char>(c);
    text += digits[byte >> 4];
    text += digits[byte & 0xf];
  }
  return text;
}

[[noreturn]] inline void malformed_unique_id(int rank, const std::string& why) {
  throw Error(rank, "NcclComm rendezvous", "the published NCCL unique id is malformed: " + why);
}

inline ncclUniqueId decode_unique_id(std::string_view text, int rank = unknown_rank) {
  if (text.size() != 2 * NCCL_UNIQUE_ID_BYTES) {
    malformed_unique_id(rank, std::to_string(text.size()) + " characters, expected " +
                                  std::to_string(2 * NCCL_UNIQUE_ID_BYTES));
  }
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  ncclUniqueId id{};
  for (std::size_t i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) {
    const int high = nibble(text[2 * i]);
    const int low = nibble(text[2 * i + 1]);
    if (high < 0 || low < 0) {
      malformed_unique_id(rank, "character " + std::to_string(2 * i) + " is not a hex digit");
    }
    id.internal[i] = static_cast<char>(static_cast<unsigned char>(high * 16 + low));
  }
  return id;
}

// --- nonblocking communicators
// ----------------------------------------------------------------------
//
// NcclComm makes every communicator nonblocking (ncclConfig_t::blocking = 0), so that no NCCL
// call can hang and ncclCommAbort can end anything. NCCL's rules for such communicators, from its
// documentation (communicators.rst, comms.rst) and checked against its source (2.18 to 2.28):
// - A call may return ncclInProgress, and ncclCommSplit may even return ncclSuccess, while its
//   work goes on in a thread of NCCL's. The communicator named in the call (for a split: the
//   parent) reports ncclInProgress through ncclCommGetAsyncError until that work has ended; poll
//   it. Any other call on it meanwhile is refused ("Attempt to use communicator before the
//   previous operation returned ncclSuccess", ncclInvalidArgument) and spoils the operation.
// - *newcomm of ncclCommInitRankConfig and ncclCommSplit is written by that thread when its work
//   ends (again, for init), and set to NULL for a rank that passed NCCL_SPLIT_NOCOLOR. So the
//   memory *newcomm points at must stay allocated until the call has settled; after a timeout
//   it may never be freed, unless the communicator was aborted.
// - Once ncclCommGetAsyncError has reported ncclSuccess, NCCL has joined its thread; the new
//   communicator then reports its own state (poll it until it is not ncclInProgress).
// - ncclCommAbort(parent) stops a split in progress and joins its thread; a child it has already
//   written must then be aborted as well. Nothing else may call NCCL on the communicator during
//   ncclCommAbort, and no operation may be outstanding on a communicator being split.

/// NCCL's colour for split(color): tandem's no_color is NCCL_SPLIT_NOCOLOR, any other colour
/// (already checked to be non-negative) is itself.
constexpr int split_color(int color) noexcept {
  return color == no_color ? NCCL_SPLIT_NOCOLOR : color;
}

// --- versions
// -------------------------------------------------------------------------------------

/// The NCCL library loaded at run time (which may be newer than the header tandem was built with).
inline int runtime_version() {
  int version = 0;
  check(ncclGetVersion(&version), unknown_rank, "ncclGetVersion");
  return version;
}

/// "2.28.9" from NCCL's version code (both encodings: 2.8 and older, and 2.9 onwards).
inline std::string version_text(int code) {
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code / 100 % 100 : code / 100 % 10;
  const int patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

/// Whether NCCL has gather, scatter and all-to-all as collectives of their own (2.28 onwards);
/// older versions run them as grouped send/recv, as NCCL's documentation shows.
inline constexpr bool native_rooted_collectives = NCCL_VERSION_CODE >= 22800;

/// "all_reduce (sequence number 12)": how errors name one operation of a communicator.
inline std::string describe_operation(const std::string& operation, std::uint64_t sequence) {
  return operation + " (sequence number " + std::to_string(sequence) + ")";
}

}  // namespace tandem::detail::nccl
