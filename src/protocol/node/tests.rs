use super::*;
use crate::protocol::rng::Rng;

/// `my_costs` as first written: the per-sink minimum over every entry of
/// every candidate, sorted by (cost, sink), the first `gossip_sinks`.
fn my_costs_reference(n: &Node) -> Vec<(NodeId, f64)> {
    let mut m: BTreeMap<NodeId, f64> = BTreeMap::new();
    for j in n.next_candidates() {
        let lc = n.link_cost(j);
        for &(sink, c) in n.peers[&j].costs.0.iter() {
            let v = lc + c;
            let e = m.entry(sink).or_insert(INF);
            if v < *e {
                *e = v;
            }
        }
    }
    let mut v: Vec<(NodeId, f64)> = m.into_iter().filter(|x| x.1 < INF).collect();
    v.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    v.truncate(n.cfg.gossip_sinks);
    v
}

/// A `Queued` notice postpones a hop's ack deadline by the reported
/// wait, but a hostile wait (u64::MAX) neither overflows nor postpones
/// it beyond the holder's last-resort timeout; a notice from another
/// peer than the hop's receiver changes nothing.
#[test]
fn a_queued_notice_postpones_a_hop_within_bounds() {
    let cfg = Arc::new(Config::new(Policy::Gwtf, 4, 1 << 20));
    let mut n = Node::new(cfg.clone(), 5, 2, 0.5, 4, 1);
    n.now = 1_000 * SEC;
    let mb = MbId {
        holder: 0,
        iter: 3,
        idx: 1,
    };
    let o = Outstanding {
        to: 9,
        sent_at: n.now,
        deadline: n.now + SEC,
        bytes: 1 << 20,
        attempt: 0,
    };
    n.acks.outstanding.insert((mb, false), o);
    n.on_queued(8, mb, 0, false, 10 * SEC);
    assert_eq!(n.acks.outstanding[&(mb, false)].deadline, n.now + SEC);
    n.on_queued(9, mb, 0, false, 10 * SEC);
    let d = n.acks.outstanding[&(mb, false)].deadline;
    assert!(d >= n.now + 20 * SEC, "{d}");
    for wait in [u64::MAX / 4, u64::MAX] {
        n.on_queued(9, mb, 0, false, wait);
        let d = n.acks.outstanding[&(mb, false)].deadline;
        assert!(d > n.now + 20 * SEC && d <= n.now + 2 * cfg.e2e_timeout + 3600 * SEC);
    }
}

/// A claim re-sent after a heartbeat period can be granted after its
/// first copy was refused (the first grant's owner died in between):
/// the coordinator then counts the microbatch as ours, so the late grant
/// must be honoured. A grant for a microbatch never claimed is ignored.
#[test]
fn a_grant_after_a_refusal_is_honoured() {
    let cfg = Config::new(Policy::Gwtf, 4, 1 << 20);
    let mut n = Node::new(Arc::new(cfg), 5, 2, 0.5, 4, 1);
    let mb = MbId {
        holder: 0,
        iter: 3,
        idx: 1,
    };
    let other = MbId { idx: 2, ..mb };
    n.member
        .acc
        .entry(3)
        .or_default()
        .pending
        .insert(mb, (1, 7, vec![11, 12]));
    n.on_claim_reply(mb, false);
    assert!(n.member.acc[&3].granted.is_empty());
    n.on_claim_reply(mb, true);
    assert_eq!(
        n.member.acc[&3].granted.get(&mb),
        Some(&(1, 7, vec![11, 12]))
    );
    assert!(n.member.acc[&3].refused.is_empty());
    // Answers to a duplicate claim change nothing.
    n.on_claim_reply(mb, true);
    n.on_claim_reply(mb, false);
    assert_eq!(n.member.acc[&3].granted.len(), 1);
    n.on_claim_reply(other, true);
    assert!(!n.member.acc[&3].granted.contains_key(&other));
}

#[test]
fn merged_cost_gossip_equals_the_full_scan() {
    for seed in 0..300 {
        let mut rng = Rng::new(seed);
        let mut cfg = Config::new(Policy::Gwtf, 4, 1 << 20);
        cfg.gossip_sinks = 1 + rng.below(20) as usize;
        let mut n = Node::new(Arc::new(cfg), 1000, 2, 0.5, 4, seed);
        n.now = 1_000;
        let sinks = 1 + rng.below(60) as u32;
        for j in 0..rng.below(40) as NodeId {
            // Costs from a few values (ties between sinks and lists).
            let list: Vec<(NodeId, f64)> = (0..rng.below(20))
                .map(|_| {
                    (
                        rng.below(sinks as u64) as NodeId,
                        0.25 * rng.below(12) as f64,
                    )
                })
                .collect();
            let stage = if rng.below(5) == 0 { 1 } else { 3 };
            let p = n.peers.get_or_insert_with(j * 7, || Peer::new(stage, 0));
            p.costs = SinkCosts::from_gossip(list.into());
            p.dead = rng.below(8) == 0;
            p.banned_until = if rng.below(8) == 0 { 5_000 } else { 0 };
            p.lat = Some([0.0, 0.25, 0.5][rng.below(3) as usize]);
            p.bw = Some(1e9);
            p.compute_s = 0.5;
        }
        // Rejections edit a list in place.
        let ids = n.peers.ids.clone();
        for j in ids {
            if rng.below(3) == 0 {
                let p = n.peers.get_mut(&j).unwrap();
                let sink = rng.below(sinks as u64) as NodeId;
                match rng.below(3) {
                    0 => p.costs.remove(sink),
                    1 => p.costs.insert(sink, INF),
                    _ => p.costs.insert(sink, 0.25 * rng.below(12) as f64),
                }
                p.costs.insert(sink, 0.25 * rng.below(12) as f64);
            }
        }
        assert_eq!(n.my_costs(), my_costs_reference(&n), "seed {seed}");
    }
}

#[test]
fn gossiped_lists_are_kept_ordered_by_cost() {
    let ordered = |c: &SinkCosts| {
        c.0.windows(2)
            .all(|w| cost_order(&w[0], &w[1]) == std::cmp::Ordering::Less)
    };
    // Out of order, a sink twice (the last one wins, as in a map).
    let mut c = SinkCosts::from_gossip(vec![(3, 2.0), (1, 1.0), (3, 0.5), (2, 1.0)].into());
    assert_eq!(*c.0, [(3, 0.5), (1, 1.0), (2, 1.0)]);
    c.insert(1, 0.1);
    c.insert(9, 0.7);
    c.remove(2);
    assert_eq!(*c.0, [(1, 0.1), (3, 0.5), (9, 0.7)]);
    assert!(ordered(&c));
    assert_eq!(c.get(9), Some(0.7));
    assert_eq!(c.get(2), None);
    // What my_costs sends is shared as it is.
    let list: Arc<[(NodeId, f64)]> = vec![(5, 0.1), (4, 0.2), (6, 0.2)].into();
    let c = SinkCosts::from_gossip(list.clone());
    assert!(Arc::ptr_eq(&c.0, &list));
    assert!(!c.material_change(&[(5, 0.1), (4, 0.2), (6, 0.201)]));
    assert!(c.material_change(&[(5, 0.1), (4, 0.2), (6, 0.3)]));
    assert!(c.material_change(&[(5, 0.1), (4, 0.2)]));
    assert!(c.material_change(&[(5, 0.1), (4, 0.2), (7, 0.2)]));
    assert!(!c.material_change(&[(4, 0.2), (5, 0.1), (6, 0.2)]));
}

#[test]
fn member_list_follows_the_set() {
    let mut m = MemberSet::default();
    for x in [5, 1, 9] {
        m.insert(x);
    }
    assert_eq!(*m.list(), vec![1, 5, 9]);
    m.remove(&5);
    assert_eq!(*m.list(), vec![1, 9]);
    let announced = Arc::new(vec![1, 2, 9]);
    m.assign(&announced, 9);
    assert!(Arc::ptr_eq(&m.list(), &announced));
    m.assign(&Arc::new(vec![1, 2]), 9);
    assert_eq!(*m.list(), vec![1, 2, 9]);
    m.assign(&Arc::new(vec![7, 3]), 9);
    assert_eq!(m.iter().copied().collect::<Vec<_>>(), vec![3, 7, 9]);
    assert_eq!(*m.list(), vec![3, 7, 9]);
}
