//! The wire encoding of protocol messages: every [`Msg`] travels as a
//! [`ControlEnvelope`] of `src/wire` (`msg_type` = the message kind,
//! `msg_version` = [`MSG_VERSION`], body = the fields below, little-endian).
//!
//! Messages that carry bulk data ([`Msg::is_bulk`]: forward activations,
//! backward gradients, bandwidth probes, state downloads) encode only their
//! metadata here; the tensor itself is the data frame that follows on the
//! same link, read straight into a pool slot by the engine.
//!
//! Decoding never panics and never allocates more than the input holds:
//! every list length is checked against the bytes left before anything is
//! reserved, options and booleans accept only 0 and 1, floats may not be
//! NaN (a hostile cost would poison the local search), unknown kinds and
//! versions and trailing bytes are refused with a typed [`WireError`].

use std::sync::Arc;

use super::types::{FlowInfo, MbId, Msg, NodeId, StageSummary};
use crate::wire::control::MAX_CONTROL_PAYLOAD;
use crate::wire::{ControlEnvelope, WireError, HEADER_LEN};

/// Version of the message bodies below.
pub const MSG_VERSION: u16 = 1;

/// Number of message kinds (`msg_type` is `0..MSG_KINDS`).
pub const MSG_KINDS: u16 = 51;

/// `msg_type` of [`Msg::Forward`] (the bulk messages that name a microbatch).
pub const KIND_FORWARD: u16 = 19;
/// `msg_type` of [`Msg::Backward`].
pub const KIND_BACKWARD: u16 = 20;

/// The `msg_type` of a message.
pub fn msg_type(m: &Msg) -> u16 {
    match m {
        Msg::Introduce { .. } => 0,
        Msg::Probe { .. } => 1,
        Msg::ProbeAck { .. } => 2,
        Msg::Heartbeat { .. } => 3,
        Msg::Goodbye => 4,
        Msg::GroupJoin { .. } => 5,
        Msg::Change { .. } => 6,
        Msg::FlowRequest { .. } => 7,
        Msg::FlowResponse { .. } => 8,
        Msg::QueryFlows => 9,
        Msg::FlowTable { .. } => 10,
        Msg::ProposeSwap { .. } => 11,
        Msg::RespondSwap { .. } => 12,
        Msg::ProposeRedirect { .. } => 13,
        Msg::RespondRedirect { .. } => 14,
        Msg::NotifySwitch { .. } => 15,
        Msg::NotifyRedirect { .. } => 16,
        Msg::PushBack { .. } => 17,
        Msg::Cancel { .. } => 18,
        Msg::Forward { .. } => KIND_FORWARD,
        Msg::Backward { .. } => KIND_BACKWARD,
        Msg::Ack { .. } => 21,
        Msg::CrashNotice { .. } => 22,
        Msg::Restart { .. } => 23,
        Msg::Redo { .. } => 24,
        Msg::StartIter { .. } => 25,
        Msg::HolderDone { .. } => 26,
        Msg::EndIter { .. } => 27,
        Msg::Claim { .. } => 28,
        Msg::ClaimReply { .. } => 29,
        Msg::Sync { .. } => 30,
        Msg::Commit { .. } => 31,
        Msg::AggDone { .. } => 32,
        Msg::Applied { .. } => 33,
        Msg::StageDone { .. } => 34,
        Msg::Finalize { .. } => 35,
        Msg::StageQuery => 36,
        Msg::StageInfo { .. } => 37,
        Msg::StateRequest => 38,
        Msg::StateResponse { .. } => 39,
        Msg::Restarting { .. } => 40,
        Msg::Queued { .. } => 41,
        Msg::AggFailed { .. } => 42,
        Msg::LinkReport { .. } => 43,
        Msg::Deputy { .. } => 44,
        Msg::Evicted { .. } => 45,
        Msg::CopyRequest { .. } => 46,
        Msg::KeptQuery { .. } => 47,
        Msg::KeptInfo { .. } => 48,
        Msg::KeptRequest { .. } => 49,
        Msg::RebuildRequest { .. } => 50,
    }
}

/// Little-endian body writer.
/// Body writer. A counting writer (`buf: None`) runs the same field code as
/// the encoder and only adds up lengths, so [`body_len`] is exact by
/// construction and allocates nothing (the simulator sizes every message
/// with it).
struct W {
    buf: Option<Vec<u8>>,
    len: usize,
}

impl W {
    fn put(&mut self, b: &[u8]) {
        self.len += b.len();
        if let Some(v) = &mut self.buf {
            v.extend_from_slice(b);
        }
    }
    fn u8(&mut self, v: u8) {
        self.put(&[v]);
    }
    fn u16(&mut self, v: u16) {
        self.put(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.u64(v.to_bits());
    }
    fn bool(&mut self, v: bool) {
        self.u8(v as u8);
    }
    fn opt<T>(&mut self, v: &Option<T>, f: impl FnOnce(&mut Self, &T)) {
        match v {
            None => self.u8(0),
            Some(x) => {
                self.u8(1);
                f(self, x);
            }
        }
    }
    fn len(&mut self, n: usize) {
        // Bodies are bounded by MAX_CONTROL_PAYLOAD (checked in `encode`), so
        // any list that fits has fewer than 2^32 elements.
        self.u32(n.min(u32::MAX as usize) as u32);
    }
    fn ids(&mut self, v: &[NodeId]) {
        self.len(v.len());
        for &x in v {
            self.u32(x);
        }
    }
    fn mb(&mut self, m: &MbId) {
        self.u32(m.holder);
        self.u32(m.iter);
        self.u32(m.idx);
    }
    fn mbs(&mut self, v: &[MbId]) {
        self.len(v.len());
        for mb in v {
            self.mb(mb);
        }
    }
    /// Microbatches with the hop each came from and went to.
    fn hops(&mut self, v: &[(MbId, NodeId, NodeId)]) {
        self.len(v.len());
        for (mb, prev, next) in v {
            self.mb(mb);
            self.u32(*prev);
            self.u32(*next);
        }
    }
    fn flow(&mut self, f: &FlowInfo) {
        self.u64(f.in_label);
        self.u32(f.sink);
        self.u32(f.prev);
        self.u32(f.next);
        self.u64(f.out_label);
        self.f64(f.cost_from_source);
        self.f64(f.cost_to_sink);
        self.f64(f.segment);
    }
}

/// Bounds-checked body reader.
struct R<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::TooShort {
                what: self.what,
                need: n,
                got: self.buf.len(),
            });
        }
        let (h, t) = self.buf.split_at(n);
        self.buf = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn f64(&mut self, field: &'static str) -> Result<f64, WireError> {
        let bits = self.u64()?;
        let v = f64::from_bits(bits);
        if v.is_nan() {
            return Err(WireError::BadField { field, value: bits });
        }
        Ok(v)
    }
    fn bool(&mut self, field: &'static str) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(WireError::BadField {
                field,
                value: v as u64,
            }),
        }
    }
    fn opt<T>(
        &mut self,
        field: &'static str,
        f: impl FnOnce(&mut Self) -> Result<T, WireError>,
    ) -> Result<Option<T>, WireError> {
        if self.bool(field)? {
            Ok(Some(f(self)?))
        } else {
            Ok(None)
        }
    }
    /// A list length, refused unless `len * elem` bytes are still there:
    /// nothing is reserved for elements the input does not hold.
    fn len(&mut self, elem: usize) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        let need = n.saturating_mul(elem);
        if need > self.buf.len() {
            return Err(WireError::TooShort {
                what: self.what,
                need,
                got: self.buf.len(),
            });
        }
        Ok(n)
    }
    fn ids(&mut self) -> Result<Vec<NodeId>, WireError> {
        let n = self.len(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    fn mb(&mut self) -> Result<MbId, WireError> {
        Ok(MbId {
            holder: self.u32()?,
            iter: self.u32()?,
            idx: self.u32()?,
        })
    }
    /// As written by `W::mbs` (12 bytes each, checked before allocating).
    fn mbs(&mut self) -> Result<Vec<MbId>, WireError> {
        let n = self.len(12)?;
        (0..n).map(|_| self.mb()).collect()
    }
    /// As written by `W::hops` (20 bytes each, checked before allocating).
    fn hops(&mut self) -> Result<Vec<(MbId, NodeId, NodeId)>, WireError> {
        let n = self.len(20)?;
        (0..n)
            .map(|_| Ok((self.mb()?, self.u32()?, self.u32()?)))
            .collect()
    }
    fn flow(&mut self) -> Result<FlowInfo, WireError> {
        Ok(FlowInfo {
            in_label: self.u64()?,
            sink: self.u32()?,
            prev: self.u32()?,
            next: self.u32()?,
            out_label: self.u64()?,
            cost_from_source: self.f64("flow.cost_from_source")?,
            cost_to_sink: self.f64("flow.cost_to_sink")?,
            segment: self.f64("flow.segment")?,
        })
    }
}

/// Encoded size of a [`FlowInfo`].
const FLOW_BYTES: usize = 52;

/// Encodes `m` as a control envelope; fails only when the body would exceed
/// the control payload limit (a list too long for one message).
pub fn encode(m: &Msg) -> Result<ControlEnvelope, WireError> {
    let mut w = W {
        buf: Some(Vec::with_capacity(64)),
        len: 0,
    };
    write_body(&mut w, m);
    let env = ControlEnvelope {
        msg_type: msg_type(m),
        msg_version: MSG_VERSION,
        body: w.buf.unwrap_or_default(),
    };
    if env.body.len() > MAX_CONTROL_PAYLOAD - ControlEnvelope::HEADER_LEN {
        return Err(WireError::BadField {
            field: "protocol message body length",
            value: env.body.len() as u64,
        });
    }
    Ok(env)
}

/// Length of `m`'s encoded body, without encoding it.
pub fn body_len(m: &Msg) -> usize {
    let mut w = W { buf: None, len: 0 };
    write_body(&mut w, m);
    w.len
}

/// Bytes `m` puts on a link: its control frame (frame header, envelope
/// header, body) and, for a bulk message, the data frame that follows it
/// (frame header and `payload` bytes: the tensor or state the message
/// announces).
pub fn link_bytes(m: &Msg, payload: u64) -> u64 {
    let control = (HEADER_LEN + ControlEnvelope::HEADER_LEN + body_len(m)) as u64;
    if m.is_bulk() {
        control + HEADER_LEN as u64 + payload
    } else {
        control
    }
}

fn write_body(w: &mut W, m: &Msg) {
    match m {
        Msg::Introduce {
            iter,
            stage,
            spare,
            compute_s,
            sent_at,
            echo,
        } => {
            w.u32(*iter);
            w.u16(*stage);
            w.u32(*spare);
            w.f64(*compute_s);
            w.u64(*sent_at);
            w.opt(echo, |w, &t| w.u64(t));
        }
        Msg::Probe { bytes, sent_at } | Msg::ProbeAck { bytes, sent_at } => {
            w.u64(*bytes);
            w.u64(*sent_at);
        }
        Msg::Heartbeat {
            members,
            coord,
            updates,
            version,
        } => {
            w.opt(members, |w, m| w.ids(m));
            w.u32(*coord);
            w.u32(*updates);
            w.u64(*version);
        }
        Msg::Goodbye | Msg::QueryFlows | Msg::StageQuery | Msg::StateRequest => {}
        Msg::CopyRequest { iteration } => w.u32(*iteration),
        Msg::GroupJoin { stage, incarnation } => {
            w.u16(*stage);
            w.u32(*incarnation);
        }
        Msg::Evicted { diverged, updates } => {
            w.bool(*diverged);
            w.u32(*updates);
        }
        Msg::Change {
            spare,
            compute_s,
            costs,
        } => {
            w.u32(*spare);
            w.f64(*compute_s);
            w.len(costs.len());
            for &(sink, c) in costs.iter() {
                w.u32(sink);
                w.f64(c);
            }
        }
        Msg::FlowRequest {
            label,
            sink,
            cost_from_source,
            expected_cost,
        } => {
            w.u64(*label);
            w.u32(*sink);
            w.f64(*cost_from_source);
            w.f64(*expected_cost);
        }
        Msg::FlowResponse {
            label,
            accept,
            cost,
            spare,
        } => {
            w.u64(*label);
            w.bool(*accept);
            w.f64(*cost);
            w.u32(*spare);
        }
        Msg::FlowTable { spare, flows } => {
            w.u32(*spare);
            w.len(flows.len());
            for f in flows {
                w.flow(f);
            }
        }
        Msg::ProposeSwap {
            mine,
            yours,
            mine_new_cost,
            temperature,
        } => {
            w.flow(mine);
            w.u64(*yours);
            w.f64(*mine_new_cost);
            w.f64(*temperature);
        }
        Msg::RespondSwap {
            accept,
            mine,
            yours,
        } => {
            w.bool(*accept);
            w.u64(*mine);
            w.opt(yours, |w, f| w.flow(f));
        }
        Msg::ProposeRedirect {
            yours,
            new_cost,
            temperature,
        } => {
            w.u64(*yours);
            w.f64(*new_cost);
            w.f64(*temperature);
        }
        Msg::RespondRedirect { accept, flow } => {
            w.bool(*accept);
            w.opt(flow, |w, f| w.flow(f));
        }
        Msg::NotifySwitch { label, new_prev } => {
            w.u64(*label);
            w.u32(*new_prev);
        }
        Msg::NotifyRedirect { label, new_next } => {
            w.u64(*label);
            w.u32(*new_next);
        }
        Msg::PushBack { label } | Msg::Cancel { label } => w.u64(*label),
        Msg::Forward {
            mb,
            attempt,
            path,
            label,
            hint,
            need_grad,
            plan,
        } => {
            w.mb(mb);
            w.u32(*attempt);
            w.ids(path);
            w.opt(label, |w, &l| w.u64(l));
            w.opt(hint, |w, &h| w.u32(h));
            w.bool(*need_grad);
            w.opt(plan, |w, p| w.ids(p));
        }
        Msg::Backward { mb, attempt, path } => {
            w.mb(mb);
            w.u32(*attempt);
            w.ids(path);
        }
        Msg::Ack {
            mb,
            attempt,
            backward,
            busy,
            bytes,
        } => {
            w.mb(mb);
            w.u32(*attempt);
            w.bool(*backward);
            w.u64(*busy);
            w.u64(*bytes);
        }
        Msg::CrashNotice {
            mb,
            attempt,
            dead,
            after,
        } => {
            w.mb(mb);
            w.u32(*attempt);
            w.u32(*dead);
            w.u32(*after);
        }
        Msg::Restart { mb, attempt } => {
            w.mb(mb);
            w.opt(attempt, |w, &a| w.u32(a));
        }
        Msg::Restarting { mb } => w.mb(mb),
        Msg::Queued {
            mb,
            attempt,
            backward,
            wait,
        } => {
            w.mb(mb);
            w.u32(*attempt);
            w.bool(*backward);
            w.u64(*wait);
        }
        Msg::Redo { mb, dead, next } => {
            w.mb(mb);
            w.u32(*dead);
            w.u32(*next);
        }
        Msg::StartIter { iter, holders } | Msg::Finalize { iter, holders } => {
            w.u32(*iter);
            w.ids(holders);
        }
        Msg::HolderDone { iter } => w.u32(*iter),
        Msg::EndIter {
            iter,
            origin,
            holders,
        } => {
            w.u32(*iter);
            w.u32(*origin);
            w.ids(holders);
        }
        Msg::Claim {
            iter,
            mb,
            prev,
            next,
        } => {
            w.u32(*iter);
            w.mb(mb);
            w.u32(*prev);
            w.u32(*next);
        }
        Msg::ClaimReply { mb, granted } => {
            w.mb(mb);
            w.bool(*granted);
        }
        Msg::Sync { iter, granted, end } => {
            w.u32(*iter);
            w.hops(granted);
            w.opt(end, |w, (origin, holders)| {
                w.u32(*origin);
                w.ids(holders);
            });
        }
        Msg::Commit {
            iter,
            epoch,
            members,
            digest,
            mine,
        } => {
            w.u32(*iter);
            w.u64(*epoch);
            w.ids(members);
            w.u64(*digest);
            w.mbs(mine);
        }
        Msg::AggDone {
            iter,
            epoch,
            weights,
        } => {
            w.u32(*iter);
            w.u64(*epoch);
            w.u64(*weights);
        }
        Msg::AggFailed { iter, epoch } => {
            w.u32(*iter);
            w.u64(*epoch);
        }
        Msg::Deputy { iter, granted } => {
            w.u32(*iter);
            w.hops(granted);
        }
        Msg::LinkReport { links } => {
            w.len(links.len());
            for (m, lat, bw) in links {
                w.u32(*m);
                w.f64(*lat);
                w.f64(*bw);
            }
        }
        Msg::Applied { iter, version } => {
            w.u32(*iter);
            w.u64(*version);
        }
        Msg::StageDone { iter, stage } => {
            w.u32(*iter);
            w.u16(*stage);
        }
        Msg::KeptQuery { stage } | Msg::KeptRequest { stage } | Msg::RebuildRequest { stage } => {
            w.u16(*stage)
        }
        Msg::KeptInfo {
            stage,
            iteration,
            open_iter,
        } => {
            w.u16(*stage);
            w.opt(iteration, |w, &i| w.u32(i));
            w.u32(*open_iter);
        }
        Msg::StageInfo { summary } => {
            w.u16(summary.stage);
            w.u32(summary.members);
            w.f64(summary.throughput);
            w.u32(summary.open_iter);
            w.len(summary.empty_neighbors.len());
            for &s in &summary.empty_neighbors {
                w.u16(s);
            }
        }
        Msg::StateResponse {
            version,
            members,
            bytes,
            coord,
        } => {
            w.u32(version.0);
            w.u64(version.1);
            w.ids(members);
            w.u64(*bytes);
            w.u32(*coord);
        }
    }
}

/// Decodes a control envelope into a protocol message.
pub fn decode(env: &ControlEnvelope) -> Result<Msg, WireError> {
    if env.msg_version != MSG_VERSION {
        return Err(WireError::UnsupportedVersion {
            what: "protocol message",
            got: env.msg_version,
        });
    }
    let mut r = R {
        buf: &env.body,
        what: "protocol message",
    };
    let r = &mut r;
    let m = match env.msg_type {
        0 => Msg::Introduce {
            iter: r.u32()?,
            stage: r.u16()?,
            spare: r.u32()?,
            compute_s: r.f64("introduce.compute_s")?,
            sent_at: r.u64()?,
            echo: r.opt("introduce.echo", |r| r.u64())?,
        },
        1 => Msg::Probe {
            bytes: r.u64()?,
            sent_at: r.u64()?,
        },
        2 => Msg::ProbeAck {
            bytes: r.u64()?,
            sent_at: r.u64()?,
        },
        3 => Msg::Heartbeat {
            members: r.opt("heartbeat.members", |r| r.ids().map(Arc::new))?,
            coord: r.u32()?,
            updates: r.u32()?,
            version: r.u64()?,
        },
        4 => Msg::Goodbye,
        5 => Msg::GroupJoin {
            stage: r.u16()?,
            incarnation: r.u32()?,
        },
        6 => {
            let spare = r.u32()?;
            let compute_s = r.f64("change.compute_s")?;
            let n = r.len(12)?;
            let costs = (0..n)
                .map(|_| Ok((r.u32()?, r.f64("change.cost")?)))
                .collect::<Result<Vec<_>, WireError>>()?;
            Msg::Change {
                spare,
                compute_s,
                costs: Arc::from(costs),
            }
        }
        7 => Msg::FlowRequest {
            label: r.u64()?,
            sink: r.u32()?,
            cost_from_source: r.f64("flow_request.cost_from_source")?,
            expected_cost: r.f64("flow_request.expected_cost")?,
        },
        8 => Msg::FlowResponse {
            label: r.u64()?,
            accept: r.bool("flow_response.accept")?,
            cost: r.f64("flow_response.cost")?,
            spare: r.u32()?,
        },
        9 => Msg::QueryFlows,
        10 => {
            let spare = r.u32()?;
            let n = r.len(FLOW_BYTES)?;
            let flows = (0..n).map(|_| r.flow()).collect::<Result<Vec<_>, _>>()?;
            Msg::FlowTable { spare, flows }
        }
        11 => Msg::ProposeSwap {
            mine: r.flow()?,
            yours: r.u64()?,
            mine_new_cost: r.f64("propose_swap.mine_new_cost")?,
            temperature: r.f64("propose_swap.temperature")?,
        },
        12 => Msg::RespondSwap {
            accept: r.bool("respond_swap.accept")?,
            mine: r.u64()?,
            yours: r.opt("respond_swap.yours", |r| r.flow())?,
        },
        13 => Msg::ProposeRedirect {
            yours: r.u64()?,
            new_cost: r.f64("propose_redirect.new_cost")?,
            temperature: r.f64("propose_redirect.temperature")?,
        },
        14 => Msg::RespondRedirect {
            accept: r.bool("respond_redirect.accept")?,
            flow: r.opt("respond_redirect.flow", |r| r.flow())?,
        },
        15 => Msg::NotifySwitch {
            label: r.u64()?,
            new_prev: r.u32()?,
        },
        16 => Msg::NotifyRedirect {
            label: r.u64()?,
            new_next: r.u32()?,
        },
        17 => Msg::PushBack { label: r.u64()? },
        18 => Msg::Cancel { label: r.u64()? },
        19 => Msg::Forward {
            mb: r.mb()?,
            attempt: r.u32()?,
            path: Arc::new(r.ids()?),
            label: r.opt("forward.label", |r| r.u64())?,
            hint: r.opt("forward.hint", |r| r.u32())?,
            need_grad: r.bool("forward.need_grad")?,
            plan: r.opt("forward.plan", |r| r.ids().map(Arc::new))?,
        },
        20 => Msg::Backward {
            mb: r.mb()?,
            attempt: r.u32()?,
            path: Arc::new(r.ids()?),
        },
        21 => Msg::Ack {
            mb: r.mb()?,
            attempt: r.u32()?,
            backward: r.bool("ack.backward")?,
            busy: r.u64()?,
            bytes: r.u64()?,
        },
        22 => Msg::CrashNotice {
            mb: r.mb()?,
            attempt: r.u32()?,
            dead: r.u32()?,
            after: r.u32()?,
        },
        23 => Msg::Restart {
            mb: r.mb()?,
            attempt: r.opt("restart.attempt", |r| r.u32())?,
        },
        24 => Msg::Redo {
            mb: r.mb()?,
            dead: r.u32()?,
            next: r.u32()?,
        },
        25 => Msg::StartIter {
            iter: r.u32()?,
            holders: Arc::new(r.ids()?),
        },
        26 => Msg::HolderDone { iter: r.u32()? },
        27 => Msg::EndIter {
            iter: r.u32()?,
            origin: r.u32()?,
            holders: Arc::new(r.ids()?),
        },
        28 => Msg::Claim {
            iter: r.u32()?,
            mb: r.mb()?,
            prev: r.u32()?,
            next: r.u32()?,
        },
        29 => Msg::ClaimReply {
            mb: r.mb()?,
            granted: r.bool("claim_reply.granted")?,
        },
        30 => {
            let iter = r.u32()?;
            let granted = r.hops()?;
            let end = r.opt("sync.end", |r| Ok((r.u32()?, Arc::new(r.ids()?))))?;
            Msg::Sync { iter, granted, end }
        }
        31 => Msg::Commit {
            iter: r.u32()?,
            epoch: r.u64()?,
            members: Arc::new(r.ids()?),
            digest: r.u64()?,
            mine: Arc::new(r.mbs()?),
        },
        32 => Msg::AggDone {
            iter: r.u32()?,
            epoch: r.u64()?,
            weights: r.u64()?,
        },
        33 => Msg::Applied {
            iter: r.u32()?,
            version: r.u64()?,
        },
        34 => Msg::StageDone {
            iter: r.u32()?,
            stage: r.u16()?,
        },
        35 => Msg::Finalize {
            iter: r.u32()?,
            holders: Arc::new(r.ids()?),
        },
        36 => Msg::StageQuery,
        37 => Msg::StageInfo {
            summary: StageSummary {
                stage: r.u16()?,
                members: r.u32()?,
                throughput: r.f64("stage_info.throughput")?,
                open_iter: r.u32()?,
                empty_neighbors: {
                    let n = r.len(2)?;
                    (0..n).map(|_| r.u16()).collect::<Result<_, _>>()?
                },
            },
        },
        38 => Msg::StateRequest,
        46 => Msg::CopyRequest {
            iteration: r.u32()?,
        },
        47 => Msg::KeptQuery { stage: r.u16()? },
        48 => Msg::KeptInfo {
            stage: r.u16()?,
            iteration: r.opt("kept_info.iteration", |r| r.u32())?,
            open_iter: r.u32()?,
        },
        49 => Msg::KeptRequest { stage: r.u16()? },
        50 => Msg::RebuildRequest { stage: r.u16()? },
        39 => Msg::StateResponse {
            version: (r.u32()?, r.u64()?),
            members: Arc::new(r.ids()?),
            bytes: r.u64()?,
            coord: r.u32()?,
        },
        40 => Msg::Restarting { mb: r.mb()? },
        41 => Msg::Queued {
            mb: r.mb()?,
            attempt: r.u32()?,
            backward: r.bool("queued.backward")?,
            wait: r.u64()?,
        },
        42 => Msg::AggFailed {
            iter: r.u32()?,
            epoch: r.u64()?,
        },
        44 => Msg::Deputy {
            iter: r.u32()?,
            granted: r.hops()?,
        },
        45 => Msg::Evicted {
            diverged: r.bool("evicted.diverged")?,
            updates: r.u32()?,
        },
        43 => Msg::LinkReport {
            links: {
                let n = r.len(20)?;
                (0..n)
                    .map(|_| {
                        Ok((
                            r.u32()?,
                            r.f64("link_report.latency")?,
                            r.f64("link_report.bandwidth")?,
                        ))
                    })
                    .collect::<Result<_, WireError>>()?
            },
        },
        t => {
            return Err(WireError::BadField {
                field: "protocol message type",
                value: t as u64,
            })
        }
    };
    if !r.buf.is_empty() {
        return Err(WireError::TrailingBytes {
            what: "protocol message",
            extra: r.buf.len(),
        });
    }
    Ok(m)
}

/// One message of every kind with non-trivial field values (tests, fuzz
/// seed corpora).
pub fn samples() -> Vec<Msg> {
    let mb = MbId {
        holder: 7,
        iter: 3,
        idx: 2,
    };
    let flow = FlowInfo {
        in_label: 11,
        sink: 4,
        prev: 5,
        next: 6,
        out_label: 12,
        cost_from_source: 1.25,
        cost_to_sink: f64::INFINITY,
        segment: 0.5,
    };
    let ids = Arc::new(vec![1, 2, 0xffff_fffe]);
    vec![
        Msg::Introduce {
            iter: 9,
            stage: 3,
            spare: 2,
            compute_s: 0.5,
            sent_at: 123,
            echo: Some(99),
        },
        Msg::Probe {
            bytes: 1 << 20,
            sent_at: 5,
        },
        Msg::ProbeAck {
            bytes: 1 << 20,
            sent_at: 5,
        },
        Msg::Heartbeat {
            members: Some(ids.clone()),
            coord: 3,
            updates: 12,
            version: 0x5eed,
        },
        Msg::Goodbye,
        Msg::GroupJoin {
            stage: 2,
            incarnation: 7,
        },
        Msg::Evicted {
            diverged: true,
            updates: 4,
        },
        Msg::Change {
            spare: 1,
            compute_s: 0.25,
            costs: Arc::from(vec![(1, 2.5), (3, -0.0)]),
        },
        Msg::FlowRequest {
            label: u64::MAX,
            sink: 1,
            cost_from_source: 3.0,
            expected_cost: 4.0,
        },
        Msg::FlowResponse {
            label: 8,
            accept: true,
            cost: 1.5,
            spare: 0,
        },
        Msg::QueryFlows,
        Msg::FlowTable {
            spare: 3,
            flows: vec![flow.clone(), flow.clone()],
        },
        Msg::ProposeSwap {
            mine: flow.clone(),
            yours: 13,
            mine_new_cost: 2.0,
            temperature: 0.1,
        },
        Msg::RespondSwap {
            accept: false,
            mine: 14,
            yours: Some(flow.clone()),
        },
        Msg::ProposeRedirect {
            yours: 15,
            new_cost: 1.0,
            temperature: 0.0,
        },
        Msg::RespondRedirect {
            accept: true,
            flow: None,
        },
        Msg::NotifySwitch {
            label: 16,
            new_prev: 17,
        },
        Msg::NotifyRedirect {
            label: 18,
            new_next: 19,
        },
        Msg::PushBack { label: 20 },
        Msg::Cancel { label: 21 },
        Msg::Forward {
            mb,
            attempt: 1,
            path: ids.clone(),
            label: Some(22),
            hint: None,
            need_grad: true,
            plan: Some(Arc::new(vec![5, 6])),
        },
        Msg::Backward {
            mb,
            attempt: 2,
            path: ids.clone(),
        },
        Msg::Ack {
            mb,
            attempt: 0,
            backward: true,
            busy: 1000,
            bytes: 4096,
        },
        Msg::CrashNotice {
            mb,
            attempt: 3,
            dead: 4,
            after: 5,
        },
        Msg::Restart {
            mb,
            attempt: Some(1),
        },
        Msg::Redo {
            mb,
            dead: 6,
            next: 7,
        },
        Msg::StartIter {
            iter: 4,
            holders: ids.clone(),
        },
        Msg::HolderDone { iter: 4 },
        Msg::EndIter {
            iter: 4,
            origin: 1,
            holders: ids.clone(),
        },
        Msg::Claim {
            iter: 4,
            mb,
            prev: 2,
            next: 3,
        },
        Msg::ClaimReply { mb, granted: true },
        Msg::Sync {
            iter: 4,
            granted: vec![(mb, 1, 2)],
            end: Some((1, ids.clone())),
        },
        Msg::Commit {
            iter: 4,
            epoch: 77,
            members: ids.clone(),
            digest: 0xd1,
            mine: Arc::new(vec![mb]),
        },
        Msg::AggDone {
            iter: 4,
            epoch: 77,
            weights: 0x5eed,
        },
        Msg::AggFailed { iter: 4, epoch: 77 },
        Msg::Deputy {
            iter: 4,
            granted: vec![(mb, 1, 2), (mb, 3, 4)],
        },
        Msg::LinkReport {
            links: vec![(3, 0.012, 1.25e8), (9, 0.2, 5e6)],
        },
        Msg::Applied {
            iter: 4,
            version: 78,
        },
        Msg::StageDone { iter: 4, stage: 2 },
        Msg::Finalize {
            iter: 4,
            holders: ids.clone(),
        },
        Msg::StageQuery,
        Msg::StageInfo {
            summary: StageSummary {
                stage: 1,
                members: 10,
                throughput: 3.5,
                open_iter: 7,
                empty_neighbors: vec![2, 4],
            },
        },
        Msg::StateRequest,
        Msg::CopyRequest { iteration: 9 },
        Msg::KeptQuery { stage: 2 },
        Msg::KeptInfo {
            stage: 2,
            iteration: Some(9),
            open_iter: 11,
        },
        Msg::KeptRequest { stage: 2 },
        Msg::RebuildRequest { stage: 2 },
        Msg::StateResponse {
            version: (4, 79),
            members: ids,
            bytes: 1 << 30,
            coord: 5,
        },
        Msg::Restarting { mb },
        Msg::Queued {
            mb,
            attempt: 1,
            backward: false,
            wait: 2500,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(m: &Msg) -> Vec<u8> {
        encode(m).unwrap().encode().unwrap()
    }

    fn from_bytes(b: &[u8]) -> Result<Msg, WireError> {
        decode(&ControlEnvelope::decode(b)?)
    }

    #[test]
    fn every_kind_roundtrips_through_the_envelope() {
        let s = samples();
        let mut kinds: Vec<u16> = s.iter().map(msg_type).collect();
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(
            kinds,
            (0..MSG_KINDS).collect::<Vec<_>>(),
            "one sample per kind"
        );
        for m in &s {
            let b = bytes(m);
            assert_eq!(&from_bytes(&b).unwrap(), m, "{}", m.name());
        }
    }

    #[test]
    fn every_truncation_and_any_trailing_byte_is_refused() {
        for m in samples() {
            let env = encode(&m).unwrap();
            for cut in 0..env.body.len() {
                let short = ControlEnvelope {
                    body: env.body[..cut].to_vec(),
                    ..env.clone()
                };
                assert!(decode(&short).is_err(), "{} cut at {cut}", m.name());
            }
            let mut long = env.clone();
            long.body.push(0);
            assert!(matches!(
                decode(&long),
                Err(WireError::TrailingBytes { .. })
            ));
        }
    }

    #[test]
    fn unknown_kind_version_nan_and_bad_tags_are_refused() {
        let env = |t: u16, body: Vec<u8>| ControlEnvelope {
            msg_type: t,
            msg_version: MSG_VERSION,
            body,
        };
        assert!(matches!(
            decode(&env(MSG_KINDS, vec![])),
            Err(WireError::BadField { .. })
        ));
        let mut v2 = encode(&Msg::Goodbye).unwrap();
        v2.msg_version = 2;
        assert!(matches!(
            decode(&v2),
            Err(WireError::UnsupportedVersion { .. })
        ));
        // A NaN cost.
        let mut b = Vec::new();
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&f64::NAN.to_bits().to_le_bytes());
        b.extend_from_slice(&1.0f64.to_bits().to_le_bytes());
        assert!(matches!(
            decode(&env(7, b)),
            Err(WireError::BadField { .. })
        ));
        // An option tag that is neither 0 nor 1.
        assert!(matches!(
            decode(&env(3, vec![2])),
            Err(WireError::BadField { .. })
        ));
        // A list announcing four billion ids in a few bytes: refused before
        // anything is reserved.
        assert!(matches!(
            decode(&env(3, vec![1, 0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4])),
            Err(WireError::TooShort { .. })
        ));
    }

    #[test]
    fn a_list_too_long_for_one_message_is_an_error_not_a_truncation() {
        let m = Msg::Heartbeat {
            members: Some(Arc::new((0..20_000).collect())),
            coord: 0,
            updates: 0,
            version: 0,
        };
        assert!(encode(&m).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bodies_never_panic_and_reencode_exactly(
            t in 0u16..MSG_KINDS + 2,
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..256),
        ) {
            let env = ControlEnvelope { msg_type: t, msg_version: MSG_VERSION, body };
            if let Ok(m) = decode(&env) {
                proptest::prop_assert_eq!(encode(&m).unwrap(), env);
            }
        }
    }
}
