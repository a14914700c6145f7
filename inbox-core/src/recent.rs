//! A bounded memory of recent deliveries, by key.

use std::collections::{HashMap, VecDeque};

/// Details of the most recent deliveries, by key (a broker position, a message ID), for what
/// must be remembered of deliveries beyond the [`Message`](crate::Message) and its
/// [`Ack`](crate::Ack) handle (the effect consumer keeps here when each message it handed back
/// may be tried again).
///
/// The consumer goes on receiving while earlier deliveries are still being applied, so this
/// cannot forget a batch when the next one arrives. It keeps the last `capacity` entries and
/// forgets the oldest first; size it well above the deliveries a consumer holds (its batch size
/// times its lanes).
#[derive(Debug)]
pub(crate) struct Recent<V> {
    capacity: usize,
    order: VecDeque<String>,
    entries: HashMap<String, V>,
}

impl<V> Recent<V> {
    /// Remembers at most `capacity` deliveries (at least 1).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            order: VecDeque::new(),
            entries: HashMap::new(),
        }
    }

    /// Remembers `value` for the delivery at `position`, forgetting the oldest when full.
    pub(crate) fn insert(&mut self, position: String, value: V) {
        if self.entries.insert(position.clone(), value).is_none() {
            self.order.push_back(position);
        }
        while self.order.len() > self.capacity {
            if let Some(oldest) = self.order.pop_front() {
                self.entries.remove(&oldest);
            }
        }
    }

    /// What was remembered for `position`, if it is still there.
    pub(crate) fn get(&self, position: &str) -> Option<&V> {
        self.entries.get(position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_is_forgotten_first() {
        let mut recent = Recent::new(2);
        recent.insert("a".into(), 1);
        recent.insert("b".into(), 2);
        recent.insert("a".into(), 3); // replaced, not added again
        assert_eq!((recent.get("a"), recent.entries.len()), (Some(&3), 2));
        recent.insert("c".into(), 4);
        assert_eq!(recent.get("a"), None);
        assert_eq!((recent.get("b"), recent.get("c")), (Some(&2), Some(&4)));
    }
}
