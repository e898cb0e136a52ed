//! The process-wide allocator: mimalloc, called the way its own `malloc` is fastest.
//!
//! The `mimalloc` crate's `GlobalAlloc` passes every request to `mi_malloc_aligned`, even at
//! the 8- or 16-byte alignment every mimalloc block has anyway. That entry point is quick only
//! for blocks up to 1 KiB whose size class happens to have a free block at hand; otherwise it
//! takes the generic aligned path, which over-allocates (size + alignment - 1) for any size
//! that is not a power of two. On the bench request that was ~18 of ~80 allocations and ~5,000
//! instructions per request (docs/performance.md). Here a request whose alignment mimalloc
//! guarantees by construction goes to plain `mi_malloc`/`mi_zalloc`/`mi_realloc`; only larger
//! alignments take the aligned entry points.

use libmimalloc_sys as mi;
use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

/// Every mimalloc block of at least 16 bytes is 16-byte aligned (size classes are multiples of
/// two words, and a page's first block starts 16-aligned); a smaller block is aligned to its
/// size rounded to a word. So an alignment up to 16 that is no larger than the size is met by
/// plain `mi_malloc`: the same rule the standard library applies to the system `malloc`.
const PLAIN_ALIGN: usize = 16;

#[inline(always)]
fn plain(align: usize, size: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size
}

pub struct Mimalloc;

// SAFETY: every pointer returned comes from mimalloc with at least the layout's size and
// alignment (see `plain`), and every pointer freed or resized was returned by it.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: plain C allocation calls; a null return is passed on as allocation failure.
        unsafe {
            if plain(layout.align(), layout.size()) {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        unsafe {
            if plain(layout.align(), layout.size()) {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator (GlobalAlloc's contract).
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout`; the new block meets the
        // alignment by the same rule as `alloc` (an in-place resize keeps the old, aligned
        // address).
        unsafe {
            if plain(layout.align(), new_size) {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size up to 5 KiB (and a few large ones) at every alignment up to 4 KiB comes back
    /// aligned, zeroed when asked, and keeps its contents through a resize.
    #[test]
    fn blocks_are_aligned_zeroed_and_resized() {
        let a = Mimalloc;
        let sizes = (1..=5120usize).chain([65_536, 100_000, 1 << 20, (1 << 22) + 24]);
        for size in sizes {
            for align in [1usize, 2, 4, 8, 16, 32, 64, 128, 4096] {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero-sized layout; each block is written within its size and
                // freed once with the layout (or resized layout) it was made with.
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    p.write_bytes(0xA5, size);
                    let grown = size * 2 + 8;
                    let q = a.realloc(p, layout, grown);
                    assert_eq!(q as usize % align, 0, "realloc size {grown} align {align}");
                    assert_eq!(*q, 0xA5);
                    assert_eq!(*q.add(size - 1), 0xA5);
                    let shrunk = size / 2 + 1;
                    let r = a.realloc(q, Layout::from_size_align(grown, align).unwrap(), shrunk);
                    assert_eq!(r as usize % align, 0, "shrink {shrunk} align {align}");
                    assert_eq!(*r, 0xA5);
                    a.dealloc(r, Layout::from_size_align(shrunk, align).unwrap());

                    let z = a.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0, "zeroed size {size} align {align}");
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                    a.dealloc(z, layout);
                }
            }
        }
    }
}
