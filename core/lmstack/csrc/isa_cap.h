// The widest vector code lmstack's C++ extensions may pick at run time. LMSTACK_MAX_ISA=avx2 runs
// the AVX2 paths on an AVX-512 CPU, =scalar the plain C++ ones; unset, "auto" or "avx512": no cap.
// Ops use it to reproduce what an older machine of their fleet runs, and a kernel author to run a
// whole model through a lower path. Every extension built through lmstack.kernels.native can
// include this header; lmstack.kernels.hardware reads the same variable (it rejects values not
// listed here) and hides the capped CPU flags from Python's choices.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace lmstack {

// Extensions number their paths 0: scalar, 1: AVX2, 2 and up: AVX-512 kinds; their best_isa()
// returns std::min(what the CPU has, isa_cap()). Read on every call: it costs ~0.1 us beside
// the CPU queries, and a test may change it.
inline int64_t isa_cap() {
  const char* v = std::getenv("LMSTACK_MAX_ISA");
  if (v != nullptr && std::strcmp(v, "scalar") == 0) return 0;
  if (v != nullptr && std::strcmp(v, "avx2") == 0) return 1;
  return std::numeric_limits<int64_t>::max();
}

}  // namespace lmstack
