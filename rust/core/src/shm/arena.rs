//! A client process's allocator of the cells of its area: a request of `r`
//! rows takes `r` consecutive free cells. Only the process that owns a
//! client slot allocates in it, so the allocator is that process's own
//! memory (a bitmap), not shared; the server never allocates.

/// Free/used bits of `cells` cells (a set bit is used).
#[derive(Debug, Clone)]
pub struct Arena {
    words: Vec<u64>,
    cells: usize,
    used: usize,
    /// Where the last single-cell search ended: the next starts there.
    hint: usize,
}

impl Arena {
    pub fn new(cells: usize) -> Arena {
        Arena {
            words: vec![0; cells.div_ceil(64)],
            cells,
            used: 0,
            hint: 0,
        }
    }

    pub fn cells(&self) -> usize {
        self.cells
    }

    pub fn used(&self) -> usize {
        self.used
    }

    fn is_used(&self, cell: usize) -> bool {
        self.words[cell / 64] & (1 << (cell % 64)) != 0
    }

    fn set(&mut self, start: usize, rows: usize, used: bool) {
        for cell in start..start + rows {
            let bit = 1u64 << (cell % 64);
            if used {
                self.words[cell / 64] |= bit;
            } else {
                self.words[cell / 64] &= !bit;
            }
        }
    }

    /// The first cell of `rows` consecutive free cells, now used; None if
    /// there is no such run (or `rows` is 0).
    pub fn alloc(&mut self, rows: usize) -> Option<usize> {
        if rows == 0 || rows > self.cells - self.used {
            return None;
        }
        let start = if rows == 1 {
            self.find_one()?
        } else {
            self.find_run(rows)?
        };
        self.set(start, rows, true);
        self.used += rows;
        Some(start)
    }

    /// A free cell, searching a word at a time from the hint, wrapping once.
    fn find_one(&mut self) -> Option<usize> {
        let n = self.words.len();
        let first = self.hint / 64;
        for k in 0..n {
            let w = (first + k) % n;
            let free = !self.words[w];
            if free != 0 {
                let cell = w * 64 + free.trailing_zeros() as usize;
                if cell < self.cells {
                    self.hint = cell;
                    return Some(cell);
                }
            }
        }
        None
    }

    fn find_run(&self, rows: usize) -> Option<usize> {
        let mut start = 0;
        while start + rows <= self.cells {
            match (start..start + rows).rev().find(|&c| self.is_used(c)) {
                None => return Some(start),
                Some(used) => start = used + 1,
            }
        }
        None
    }

    /// Gives back cells `start..start + rows` (all used).
    ///
    /// # Panics
    /// If a cell in the range is out of bounds or free: a double free.
    pub fn free(&mut self, start: usize, rows: usize) {
        assert!(start + rows <= self.cells, "cells out of bounds");
        assert!(
            (start..start + rows).all(|c| self.is_used(c)),
            "cells freed twice"
        );
        self.set(start, rows, false);
        self.used -= rows;
    }

    /// Frees everything.
    pub fn clear(&mut self) {
        self.words.fill(0);
        self.used = 0;
        self.hint = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn single_cells_until_full_then_none() {
        let mut a = Arena::new(70);
        let cells: Vec<usize> = (0..70).map(|_| a.alloc(1).unwrap()).collect();
        let mut sorted = cells.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..70).collect::<Vec<_>>());
        assert_eq!(a.alloc(1), None);
        a.free(65, 1);
        assert_eq!(a.alloc(1), Some(65));
    }

    #[test]
    fn runs_are_consecutive_and_fragmentation_refuses() {
        let mut a = Arena::new(8);
        assert_eq!(a.alloc(3), Some(0));
        assert_eq!(a.alloc(3), Some(3));
        assert_eq!(a.alloc(3), None, "2 cells left");
        a.free(0, 3);
        assert_eq!(a.alloc(4), None, "3 + 2 free, but not consecutive");
        assert_eq!(a.alloc(2), Some(0));
        assert_eq!(a.used(), 5);
        assert_eq!(a.alloc(0), None);
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn a_double_free_panics() {
        let mut a = Arena::new(4);
        let c = a.alloc(2).unwrap();
        a.free(c, 2);
        a.free(c, 1);
    }

    proptest! {
        /// Against a model: allocations never overlap, frees give cells
        /// back, and a run is found whenever the model has one.
        #[test]
        fn matches_a_model(ops in proptest::collection::vec((1usize..5, any::<bool>()), 1..200)) {
            let cells = 40;
            let mut a = Arena::new(cells);
            let mut model = vec![false; cells];
            let mut live: Vec<(usize, usize)> = Vec::new();
            for (rows, free_one) in ops {
                if free_one && !live.is_empty() {
                    let (s, r) = live.swap_remove(rows % live.len());
                    a.free(s, r);
                    model[s..s + r].iter_mut().for_each(|c| *c = false);
                    continue;
                }
                let has_run = model.windows(rows).any(|w| w.iter().all(|c| !c));
                match a.alloc(rows) {
                    Some(s) => {
                        prop_assert!(model[s..s + rows].iter().all(|c| !c), "overlap");
                        model[s..s + rows].iter_mut().for_each(|c| *c = true);
                        live.push((s, rows));
                    }
                    None => prop_assert!(!has_run, "a free run of {} was missed", rows),
                }
                prop_assert_eq!(a.used(), model.iter().filter(|c| **c).count());
            }
        }
    }
}
