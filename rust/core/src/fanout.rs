//! Fan-out bookkeeping: which rows of a batch output belong to which request,
//! grouped by the event loop that must be woken, so a batch wakes each loop once.

use std::sync::Arc;

use crate::Request;

/// Rows `start..start + rows` of the batch output belong to request `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub id: u64,
    pub start: u32,
    pub rows: u32,
}

/// The routes of one batch, one group per event loop, each in batch order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routes {
    pub groups: Vec<(u32, Vec<Route>)>,
}

impl Routes {
    /// Lays `requests` out back to back, in order, as collation does.
    pub fn for_batch(requests: &[Arc<Request>]) -> Routes {
        let mut groups: Vec<(u32, Vec<Route>)> = Vec::new();
        let mut start = 0u32;
        for r in requests {
            let route = Route {
                id: r.id,
                start,
                rows: r.rows,
            };
            start += r.rows;
            // Few loops per batch: a linear search beats hashing here.
            match groups.iter_mut().find(|(loop_id, _)| *loop_id == r.loop_id) {
                Some((_, routes)) => routes.push(route),
                None => groups.push((r.loop_id, vec![route])),
            }
        }
        Routes { groups }
    }

    pub fn len(&self) -> usize {
        self.groups.iter().map(|(_, g)| g.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_rows_back_to_their_requests_grouped_by_loop() {
        let reqs: Vec<_> = [(10, 0, 1), (11, 1, 2), (12, 0, 3), (13, 2, 1)]
            .iter()
            .map(|&(id, lp, rows)| Arc::new(Request::new(id, lp, rows, Box::new([]), None)))
            .collect();
        let routes = Routes::for_batch(&reqs);
        assert_eq!(
            routes.groups,
            vec![
                (
                    0,
                    vec![
                        Route {
                            id: 10,
                            start: 0,
                            rows: 1
                        },
                        Route {
                            id: 12,
                            start: 3,
                            rows: 3
                        }
                    ]
                ),
                (
                    1,
                    vec![Route {
                        id: 11,
                        start: 1,
                        rows: 2
                    }]
                ),
                (
                    2,
                    vec![Route {
                        id: 13,
                        start: 6,
                        rows: 1
                    }]
                ),
            ]
        );
        assert_eq!(routes.len(), 4);
    }
}
