// The AMX tile unit (Sapphire Rapids and later), as the GGUF-block and bfloat16 projections use it: the
// process's permission to use the tile registers, and one tile configuration both kernels' tiles fit.
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvpilot {

// The kernel's permission to use the tile registers (Linux: ARCH_REQ_XCOMP_PERM, once per process),
// and whether the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22).
inline bool amx_usable() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

constexpr int64_t AMX_TILE_ROWS = 16;  // rows of every tile here; each row 64 bytes (32 bfloat16s or 16 float32s)

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// All eight tiles 16 rows of 64 bytes. A constant in memory: GCC drops stores into a local that only
// LDTILECFG reads (seen: palette set, every tile 0 x 0, and the first tile instruction raised SIGILL).
inline constexpr TileConfig kTiles{1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// Tile state is per thread: configured on each thread that multiplies, released when it is done.
__attribute__((target("amx-tile"))) inline void amx_configure() { _tile_loadconfig(&kTiles); }
__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }

}  // namespace kvpilot
