//! Gates 2–4 as one all-or-nothing reservation: on the local ledger alone (memory, sqlite),
//! or on a shared store first (redis) with the local ledger mirroring it.

use super::plan::PartInfo;
use super::Governor;
use crate::ledger::{Refusal, Reservation, SharedCounters, SharedPart, SharedReply};
use crate::policy::{OnUnavailable, Policy};
use crate::units::{Amount, Millis, Scope};

/// Why no reservation was made.
pub(super) enum ReserveError {
    /// A hard limit would be crossed.
    Refused(Refusal),
    /// The shared store did not answer and `state.on_unavailable` is `deny`.
    Unavailable,
    /// The shared store lost its counters and they are being rebuilt (any `on_unavailable`).
    Rebuilding,
}

impl Governor {
    /// Reserves `amount` on every part of `all`. Without a shared store this is the local
    /// ledger's lock-free reservation and nothing else (no await, no extra allocation).
    pub(super) async fn reserve_all(
        &self,
        policy: &Policy,
        all: &[&PartInfo],
        amount: Amount,
        now: Millis,
    ) -> Result<Reservation, ReserveError> {
        let reserve: Vec<_> = all.iter().map(|p| p.reserve_part()).collect();
        let Some(shared) = &self.shared else {
            return self.reserve_local(&reserve, amount);
        };
        // Boxed so that the local path's future does not carry the shared path's state.
        pin_in_place!(self.reserve_shared(&**shared, policy, all, reserve, amount, now)).await
    }

    /// The local ledger's lock-free reservation.
    fn reserve_local(
        &self,
        reserve: &[crate::ledger::ReservePart],
        amount: Amount,
    ) -> Result<Reservation, ReserveError> {
        self.ledger
            .reserve(reserve, amount)
            .map_err(ReserveError::Refused)
    }

    async fn reserve_shared(
        &self,
        shared: &dyn SharedCounters,
        policy: &Policy,
        all: &[&PartInfo],
        mut reserve: Vec<crate::ledger::ReservePart>,
        amount: Amount,
        now: Millis,
    ) -> Result<Reservation, ReserveError> {
        // A request's own counter lives and dies with the request: it stays local. So does an
        // undeclared job's (the job is the request alone): it would only leave keys behind.
        let idx: Vec<usize> = (0..all.len())
            .filter(|&i| all[i].key.scope != Scope::Request && !all[i].ephemeral)
            .collect();
        if idx.is_empty() {
            return self.reserve_local(&reserve, amount);
        }
        let parts: Vec<SharedPart<'_>> = idx
            .iter()
            .map(|&i| SharedPart {
                key: &all[i].key,
                hard: all[i].hard,
                expires_at: all[i].counter.expires_at(),
            })
            .collect();
        let mirror = |committed: &[Amount]| {
            for (&i, c) in idx.iter().zip(committed) {
                all[i].counter.mirror_committed(c);
            }
        };
        match shared.reserve(&parts, amount, now).await {
            Ok(SharedReply::Held { hold, committed }) => {
                mirror(&committed);
                // The store has judged the shared limits; locally they are only mirrored.
                for &i in &idx {
                    reserve[i].hard = [None; 3];
                }
                match self.ledger.reserve(&reserve, amount) {
                    Ok(mut r) => {
                        r.attach(hold);
                        Ok(r)
                    }
                    // A request-scoped limit refused: dropping `hold` releases it.
                    Err(refusal) => Err(ReserveError::Refused(refusal)),
                }
            }
            Ok(SharedReply::Rebuilding) => Err(ReserveError::Rebuilding),
            Ok(SharedReply::Refused {
                part,
                refusal,
                committed,
            }) => {
                for (&i, c) in idx.iter().zip(&committed) {
                    if let Some(c) = c {
                        all[i].counter.mirror_committed(c);
                    }
                }
                Err(ReserveError::Refused(Refusal {
                    part: idx[part],
                    refusal,
                }))
            }
            Err(_) => match policy.state.on_unavailable {
                // Slices: the replica admitted what it holds already; past it, refuse.
                OnUnavailable::Local if shared.bounded_offline() => Err(ReserveError::Unavailable),
                OnUnavailable::Local => {
                    let mut r = self.reserve_local(&reserve, amount)?;
                    // What this request uses is written back once the store answers.
                    if let Some(owed) = shared.offline_hold(&parts, now) {
                        r.attach(owed);
                    }
                    Ok(r)
                }
                OnUnavailable::Deny => Err(ReserveError::Unavailable),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    //! The seam with a store that answers as told (the Redis store itself is tested against
    //! a real Redis in tests/state_redis*.rs).
    use super::super::*;
    use crate::ledger::shared::ReserveFuture;
    use crate::ledger::{DimRefusal, SharedHold, SharedPart, SharedReply, StoreUnavailable};
    use crate::policy::Policy;
    use crate::units::{Amount, Dim, Millis, Scope};
    use std::sync::Mutex;

    #[derive(Debug, Clone, Copy)]
    enum Answer {
        Held(Amount),
        Refuse(usize, Dim),
        Down,
    }

    #[derive(Debug, Default)]
    struct Log {
        asked: Vec<Vec<Scope>>,
        /// Owed holds made while the store was down, by their parts' scopes.
        owed: Vec<Vec<Scope>>,
        settled: Vec<Option<Amount>>,
    }

    #[derive(Debug)]
    struct Fake {
        answer: Answer,
        log: Arc<Mutex<Log>>,
    }

    #[derive(Debug)]
    struct FakeHold(Arc<Mutex<Log>>, bool);

    impl SharedHold for FakeHold {
        fn settle(mut self: Box<Self>, actual: Amount) {
            self.1 = true;
            self.0.lock().unwrap().settled.push(Some(actual));
        }
    }

    impl Drop for FakeHold {
        fn drop(&mut self) {
            if !self.1 {
                self.0.lock().unwrap().settled.push(None);
            }
        }
    }

    impl SharedCounters for Fake {
        fn reserve<'a>(
            &'a self,
            parts: &'a [SharedPart<'a>],
            _amount: Amount,
            _now: Millis,
        ) -> ReserveFuture<'a> {
            self.log
                .lock()
                .unwrap()
                .asked
                .push(parts.iter().map(|p| p.key.scope).collect());
            let committed = vec![self.committed(); parts.len()];
            let r = match self.answer {
                Answer::Held(_) => Ok(SharedReply::Held {
                    hold: Box::new(FakeHold(self.log.clone(), false)),
                    committed,
                }),
                Answer::Refuse(part, dim) => Ok(SharedReply::Refused {
                    part,
                    refusal: DimRefusal {
                        dim,
                        used: 10,
                        hard: 10,
                    },
                    committed: committed.into_iter().map(Some).collect(),
                }),
                Answer::Down => Err(StoreUnavailable),
            };
            Box::pin(std::future::ready(r))
        }

        fn offline_hold(
            &self,
            parts: &[SharedPart<'_>],
            _now: Millis,
        ) -> Option<Box<dyn SharedHold>> {
            let mut log = self.log.lock().unwrap();
            log.owed.push(parts.iter().map(|p| p.key.scope).collect());
            Some(Box::new(FakeHold(self.log.clone(), false)))
        }
    }

    impl Fake {
        fn committed(&self) -> Amount {
            match self.answer {
                Answer::Held(c) => c,
                _ => Amount::ZERO,
            }
        }
    }

    use super::super::tests::fakes::{At, Ok200};

    fn policy(on_unavailable: &str, request_hard: u64) -> Policy {
        crate::policy::from_str(
            &format!(
                "version: s-1
backends: [{{id: primary, kind: openai, base_url: 'http://127.0.0.1:9/v1'}}]
routes: [{{model: chat, chain: [{{backend: primary, model: small}}]}}]
quotas: [{{name: daily, scope: consumer, match: '*', window: day, limit_requests: 10}}]
budgets:
  - {{name: job, scope: job, hard_tokens: 100000}}
  - {{name: req, scope: request, hard_tokens: {request_hard}}}
state: {{backend: redis, redis_url: 'redis://127.0.0.1:1', on_unavailable: {on_unavailable}}}
"
            ),
            "s.yaml",
        )
        .unwrap()
    }

    fn ctx() -> RequestCtx {
        RequestCtx {
            request_id: Arc::from("r1"),
            job_id: Arc::from("j1"),
            consumer: Arc::from("alice"),
            team: None,
            input_tokens: 10,
            max_output_tokens: Some(20),
            n: 1,
            static_ok: false,
        }
    }

    async fn run(
        answer: Answer,
        mode: &str,
        request_hard: u64,
    ) -> (Governor, Outcome<()>, Arc<Mutex<Log>>, Policy) {
        let log = Arc::new(Mutex::new(Log::default()));
        let fake = Fake {
            answer,
            log: log.clone(),
        };
        let g = Governor::with_shared(Arc::new(Ledger::new()), Arc::new(fake));
        let p = policy(mode, request_hard);
        let route = p.route("chat").unwrap().clone();
        let out = g
            .govern(&p, &route, &ctx(), &Ok200, &At(1_800_000_000_000))
            .await;
        (g, out, log, p)
    }

    #[tokio::test]
    async fn a_held_reservation_mirrors_the_shared_totals_and_settles_its_hold() {
        let shared = Amount {
            tokens: 500,
            requests: 7,
            usd: 0,
        };
        let (g, out, log, p) = run(Answer::Held(shared), "deny", 1000).await;
        assert_eq!(out.record.final_action, FinalAction::Allow);
        // The request's own counter never leaves the process.
        assert_eq!(
            log.lock().unwrap().asked,
            vec![vec![Scope::Consumer, Scope::Job]]
        );
        let consumer = g
            .ledger
            .snapshot()
            .into_iter()
            .find(|(k, _, _)| k.scope == Scope::Consumer)
            .unwrap();
        assert_eq!(consumer.1, shared, "committed mirrors the store");
        assert_eq!(consumer.2.tokens, 30, "the worst case is held locally too");
        settle_10_in_5_out(&g, &p, out);
        assert_eq!(log.lock().unwrap().settled, vec![Some(SETTLED)]);
    }

    #[tokio::test]
    async fn a_shared_refusal_names_the_right_bound() {
        let (_, out, log, _) = run(Answer::Refuse(0, Dim::Requests), "deny", 1000).await;
        assert_eq!(out.record.reason_class, ReasonClass::QuotaBlocked);
        assert_eq!(out.record.http_status, 403);
        assert_eq!(&*out.record.refusals[0].name, "daily");
        assert!(log.lock().unwrap().settled.is_empty(), "nothing was held");
    }

    #[tokio::test]
    async fn a_local_refusal_after_a_shared_hold_releases_it() {
        // 30 tokens of worst case do not fit the request's own 20.
        let (_, out, log, _) = run(Answer::Held(Amount::ZERO), "deny", 20).await;
        assert_eq!(out.record.reason_class, ReasonClass::HardBudgetExceeded);
        assert_eq!(
            log.lock().unwrap().settled,
            vec![None],
            "released, not committed"
        );
    }

    /// What `settle_10_in_5_out` commits.
    const SETTLED: Amount = Amount {
        tokens: 15,
        requests: 1,
        usd: 0,
    };

    /// Settles a served outcome with 10 input and 5 output tokens.
    fn settle_10_in_5_out(g: &Governor, p: &Policy, out: Outcome<()>) {
        let Served::Upstream { pending, .. } = out.served else {
            panic!("served")
        };
        let mut rec = out.record;
        let usage = Usage::new(10, 5);
        g.settle(p, &mut rec, *pending, usage, UsageEvidence::Actual);
    }

    async fn log_of(answer: Answer, mode: &str) -> Log {
        let (_, _, log, _) = run(answer, mode, 1000).await;
        let log = std::mem::take(&mut *log.lock().unwrap());
        log
    }

    #[tokio::test]
    async fn an_unavailable_store_denies_with_503_or_falls_back_to_local() {
        let (_, out, _, _) = run(Answer::Down, "deny", 1000).await;
        assert_eq!(out.record.reason_class, ReasonClass::StateUnavailable);
        assert_eq!(out.record.final_action, FinalAction::Defer);
        assert_eq!(
            (out.record.http_status, out.record.retry_after),
            (503, Some(1))
        );
        assert!(matches!(out.served, Served::Refused));

        assert!(log_of(Answer::Down, "deny").await.owed.is_empty());

        let (g, out, log, p) = run(Answer::Down, "local", 1000).await;
        assert_eq!(out.record.final_action, FinalAction::Allow);
        assert!(g.ledger.reserved_tokens() > 0, "held in the local ledger");
        // What the request uses is owed to the store: its shared counters, settled with the
        // actual usage.
        assert_eq!(
            log.lock().unwrap().owed,
            vec![vec![Scope::Consumer, Scope::Job]]
        );
        settle_10_in_5_out(&g, &p, out);
        assert_eq!(log.lock().unwrap().settled, vec![Some(SETTLED)]);
        // Locally, the hard limits still hold.
        let (_, out, _, _) = run(Answer::Down, "local", 20).await;
        assert_eq!(out.record.reason_class, ReasonClass::HardBudgetExceeded);
    }
}
