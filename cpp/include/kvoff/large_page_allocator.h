// An allocator for large per-slot arrays that asks the kernel for transparent huge pages.
//
// The manager's per-slot arrays (key-index buckets and records, the free list) are read at
// random: with 4 KiB pages a pool of 1M slots spans ~23,000 pages, far more than the TLB holds,
// so nearly every access also walks the page table. Backing them with 2 MiB pages (Linux
// transparent huge pages, madvise mode) keeps the whole pool within TLB reach.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvoff {

/// std::allocator-compatible: allocations of at least kLargePageBytes are aligned to 2 MiB,
/// rounded up to a multiple of it and marked MADV_HUGEPAGE (Linux; a no-op hint elsewhere, and
/// harmless when transparent huge pages are disabled). Smaller ones use operator new.
/// Throws std::bad_alloc when memory is exhausted.
template <typename T>
class LargePageAllocator {
 public:
  using value_type = T;
  /// Allocations from this size (bytes) on get huge pages.
  static constexpr std::size_t kLargePageBytes = std::size_t{2} << 20;

  LargePageAllocator() noexcept = default;
  template <typename U>
  LargePageAllocator(const LargePageAllocator<U>& /*other*/) noexcept {}  // NOLINT

  /// Memory for `n` objects of T (uninitialized).
  T* allocate(std::size_t n) {
    // Bound the size so that rounding up to whole large pages cannot overflow and no object
    // exceeds PTRDIFF_MAX bytes.
    constexpr std::size_t kMaxBytes = static_cast<std::size_t>(PTRDIFF_MAX) - kLargePageBytes;
    if (n > kMaxBytes / sizeof(T)) {
      throw std::bad_alloc();
    }
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kLargePageBytes) {
      return static_cast<T*>(::operator new(bytes, std::align_val_t{alignof(T)}));
    }
    const std::size_t rounded = (bytes + kLargePageBytes - 1) / kLargePageBytes * kLargePageBytes;
    void* p = std::aligned_alloc(kLargePageBytes, rounded);
    if (p == nullptr) {
      throw std::bad_alloc();
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    ::madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure only costs speed
#endif
    return static_cast<T*>(p);
  }

  /// Frees memory from allocate(n) with the same n.
  void deallocate(T* p, std::size_t n) noexcept {
    if (n * sizeof(T) < kLargePageBytes) {
      ::operator delete(p, std::align_val_t{alignof(T)});
    } else {
      std::free(p);
    }
  }

  template <typename U>
  bool operator==(const LargePageAllocator<U>& /*other*/) const noexcept {
    return true;
  }
};

}  // namespace kvoff
