//! Fan-out bookkeeping: which rows of a batch output belong to which request,
//! grouped by the sink their results go to, so a batch wakes each sink's
//! owner once, whatever mix of sinks it holds.

use std::sync::Arc;

use crate::Request;

/// Where a request's result goes. Each kind has one owner that delivers it:
/// an event loop's mailbox (the binding's loop registry), a thread's waiter,
/// the native front-end's reply table, a client process attached through
/// shared memory.
/// A batch's rows are grouped by sink in one pass ([`Routes::for_batch`]),
/// and each group is handed to its owner with one wake-up per batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sink {
    /// An asyncio event loop's mailbox, by loop id.
    EventLoop(u32),
    /// Callers blocked in plain threads (not on an event loop), waiting in
    /// their server's table of thread waiters.
    Thread,
    /// Requests of the native front-end, answered through its reply table
    /// (the id names the table).
    Connection(u64),
    /// A client process attached through shared memory, by client slot.
    SharedMemory(u32),
}

/// Rows `start..start + rows` of the batch output belong to request `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub id: u64,
    pub start: u32,
    pub rows: u32,
}

/// The routes of one batch, one group per sink, each in batch order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routes {
    pub groups: Vec<(Sink, Vec<Route>)>,
}

impl Routes {
    /// Lays `requests` out back to back, in order, as collation does.
    pub fn for_batch(requests: &[Arc<Request>]) -> Routes {
        let mut groups: Vec<(Sink, Vec<Route>)> = Vec::new();
        let mut start = 0u32;
        for r in requests {
            let route = Route {
                id: r.id,
                start,
                rows: r.rows,
            };
            start += r.rows;
            // Few sinks per batch: a linear search beats hashing here.
            match groups.iter_mut().find(|(sink, _)| *sink == r.sink) {
                Some((_, routes)) => routes.push(route),
                None => groups.push((r.sink, vec![route])),
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
    fn routes_rows_back_to_their_requests_grouped_by_sink() {
        let reqs: Vec<_> = [(10, 0, 1), (11, 1, 2), (12, 0, 3), (13, 2, 1)]
            .iter()
            .map(|&(id, lp, rows)| {
                Arc::new(Request::new(
                    id,
                    Sink::EventLoop(lp),
                    rows,
                    crate::Inputs::default(),
                    None,
                ))
            })
            .collect();
        let routes = Routes::for_batch(&reqs);
        assert_eq!(
            routes.groups,
            vec![
                (
                    Sink::EventLoop(0),
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
                    Sink::EventLoop(1),
                    vec![Route {
                        id: 11,
                        start: 1,
                        rows: 2
                    }]
                ),
                (
                    Sink::EventLoop(2),
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

    #[test]
    fn one_pass_groups_rows_for_sinks_of_every_kind() {
        let sinks = [
            Sink::EventLoop(0),
            Sink::Connection(7),
            Sink::EventLoop(0),
            Sink::SharedMemory(2),
            Sink::Connection(7),
            Sink::Connection(8),
        ];
        let reqs: Vec<_> = sinks
            .iter()
            .enumerate()
            .map(|(i, &sink)| {
                Arc::new(Request::new(
                    i as u64,
                    sink,
                    1,
                    crate::Inputs::default(),
                    None,
                ))
            })
            .collect();
        let routes = Routes::for_batch(&reqs);
        let groups: Vec<(Sink, Vec<u64>)> = routes
            .groups
            .iter()
            .map(|(sink, r)| (*sink, r.iter().map(|r| r.id).collect()))
            .collect();
        assert_eq!(
            groups,
            vec![
                (Sink::EventLoop(0), vec![0, 2]),
                (Sink::Connection(7), vec![1, 4]),
                (Sink::SharedMemory(2), vec![3]),
                (Sink::Connection(8), vec![5]),
            ]
        );
    }
}
