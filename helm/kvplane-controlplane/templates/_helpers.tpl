{{/*
Shared names, labels and checks for the kvplane control-plane chart.
*/}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "kvplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full resource name: fullnameOverride, or <release>-<name> (the release name alone when it
already contains the chart name). */}}
{{- define "kvplane.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart label value: name-version. */}}
{{- define "kvplane.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the pods; never change them after the first install. */}}
{{- define "kvplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controlplane
{{- end }}

{{/* Labels on every resource. */}}
{{- define "kvplane.labels" -}}
helm.sh/chart: {{ include "kvplane.chart" . }}
{{ include "kvplane.selectorLabels" . }}
{{- $version := .Values.image.tag | toString | trunc 63 | trimAll "-._" }}
{{- if $version }}
app.kubernetes.io/version: {{ $version | quote }}
{{- end }}
app.kubernetes.io/part-of: kvplane
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "kvplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvplane.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image reference: repository:tag, or repository@digest when a digest is pinned. */}}
{{- define "kvplane.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}
{{- end }}

{{/*
The container's own gRPC and metrics ports: fixed and unprivileged. The pod runs as uid 10001 with
every capability dropped, so it cannot bind below 1024; service.grpcPort / service.metricsPort are
the Service's ports (any of 1-65535, e.g. 443), which target these by name.
*/}}
{{- define "kvplane.grpcContainerPort" -}}50051{{- end }}
{{- define "kvplane.metricsContainerPort" -}}9090{{- end }}

{{/* Paths inside the container. */}}
{{- define "kvplane.policyDir" -}}/etc/kvplane/policy{{- end }}
{{- define "kvplane.tokenDir" -}}/etc/kvplane/token{{- end }}
{{- define "kvplane.tlsDir" -}}/etc/kvplane/tls{{- end }}

{{/*
The rendered policy file (also hashed into the pod annotation so a change rolls pods).
Not toYaml: Helm reads numbers from values files as float64 and Go writes 1073741824 as
1.073741824e+09 and 0.0000001 as 1e-07; YAML 1.1 loaders (PyYAML, used by the server) read the
first as a float (rejected for integer fields) and the second as a string.
kvplane.policyScalar writes integral numbers as integers and small ones as 1.0e-07. The schema
limits the policy to two levels of scalars.
*/}}
{{- define "kvplane.policyFile" -}}
{{- range $key, $value := .Values.policy }}
{{- if kindIs "map" $value }}
{{ $key }}:
{{- range $inner, $v := $value }}
  {{ $inner }}: {{ include "kvplane.policyScalar" $v }}
{{- end }}
{{- else }}
{{ $key }}: {{ include "kvplane.policyScalar" $value }}
{{- end }}
{{- end }}
{{- end }}

{{/* One policy value as a YAML 1.1 scalar that Python loaders type correctly. */}}
{{- define "kvplane.policyScalar" -}}
{{- if kindIs "string" . }}
{{- toJson . }}
{{- else }}
{{- include "kvplane.number" . }}
{{- end }}
{{- end }}

{{/* A number as Python's int()/float() and YAML 1.1 read it (no 1e+06, no 4.194304e+06). */}}
{{- define "kvplane.number" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}
{{- /* values files give every number as float64; integral ones are written as integers */}}
{{- int64 . | toString }}
{{- else if kindIs "float64" . }}
{{- $s := toString . }}
{{- if and (contains "e" $s) (not (contains "." $s)) }}
{{- $s = replace "e" ".0e" $s }}
{{- end }}
{{- $s }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* A Prometheus duration as the schema allows it (units in order: 1h30m, 45s, 500ms) in
milliseconds. Numbers are decimal (`atoi`): Sprig's `int64` auto-detects the base, reading "010"
as 8 and "08" as 0 (the deploy fixes' review, session 87). */}}
{{- define "kvplane.durationMs" -}}
{{- $ms := 0 }}
{{- range regexFindAll "[0-9]+(ms|h|m|s)" . -1 }}
{{- if hasSuffix "ms" . }}
{{- $ms = add $ms (trimSuffix "ms" . | atoi) }}
{{- else if hasSuffix "h" . }}
{{- $ms = add $ms (mul (trimSuffix "h" . | atoi) 3600000) }}
{{- else if hasSuffix "m" . }}
{{- $ms = add $ms (mul (trimSuffix "m" . | atoi) 60000) }}
{{- else }}
{{- $ms = add $ms (mul (trimSuffix "s" . | atoi) 1000) }}
{{- end }}
{{- end }}
{{- $ms }}
{{- end }}

{{/*
Cross-field checks the JSON schema cannot express. Each failure names the field, the value
and the allowed range.
*/}}
{{- define "kvplane.validate" -}}
{{- $p := .Values.policy }}
{{- $wmin := default 4 $p.window_min | int64 }}
{{- $wmax := default 64 $p.window_max | int64 }}
{{- if lt $wmax $wmin }}
{{- fail (printf "policy.window_max: %d is below policy.window_min = %d (allowed: window_max >= window_min)" $wmax $wmin) }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "tls.existingSecret: must name an existing Secret when tls.enabled is true" }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- if gt (int64 .Values.autoscaling.minReplicas) (int64 .Values.autoscaling.maxReplicas) }}
{{- fail (printf "autoscaling.maxReplicas: %d is below autoscaling.minReplicas = %d (allowed: maxReplicas >= minReplicas)" (int64 .Values.autoscaling.maxReplicas) (int64 .Values.autoscaling.minReplicas)) }}
{{- end }}
{{- if and (kindIs "invalid" .Values.autoscaling.targetCPUUtilizationPercentage) (kindIs "invalid" .Values.autoscaling.targetMemoryUtilizationPercentage) }}
{{- fail "autoscaling: set targetCPUUtilizationPercentage or targetMemoryUtilizationPercentage (both are null)" }}
{{- end }}
{{- end }}
{{- if .Values.podDisruptionBudget.enabled }}
{{- $min := .Values.podDisruptionBudget.minAvailable }}
{{- $max := .Values.podDisruptionBudget.maxUnavailable }}
{{- if eq (kindIs "invalid" $min) (kindIs "invalid" $max) }}
{{- fail "podDisruptionBudget: set exactly one of minAvailable and maxUnavailable (the other null)" }}
{{- end }}
{{- $replicas := ternary .Values.autoscaling.minReplicas .Values.replicaCount .Values.autoscaling.enabled | int64 }}
{{- $source := ternary "autoscaling.minReplicas" "replicaCount" .Values.autoscaling.enabled }}
{{- if and (not (kindIs "invalid" $min)) (not (kindIs "string" $min)) (ge (int64 $min) $replicas) }}
{{- fail (printf "podDisruptionBudget.minAvailable: %d is not below %s = %d (no pod could ever be evicted: a node drain would wait for ever; raise %s or use maxUnavailable)" (int64 $min) $source $replicas $source) }}
{{- end }}
{{- if and (kindIs "string" $min) (hasSuffix "%" $min) }}
{{- /* Kubernetes rounds a percentage of minAvailable up: ceil(pct x replicas / 100) pods */}}
{{- $pods := div (add (mul (trimSuffix "%" $min | int64) $replicas) 99) 100 }}
{{- if ge $pods $replicas }}
{{- fail (printf "podDisruptionBudget.minAvailable: %q of %s = %d rounds up to %d pods, all of them (no pod could ever be evicted: a node drain would wait for ever; lower it or use maxUnavailable)" $min $source $replicas $pods) }}
{{- end }}
{{- end }}
{{- if and (not (kindIs "invalid" $max)) (or (eq (toString $max) "0") (eq (toString $max) "0%")) }}
{{- fail (printf "podDisruptionBudget.maxUnavailable: %v lets no pod be evicted (a node drain would wait for ever)" $max) }}
{{- end }}
{{- end }}
{{- if .Values.serviceMonitor.enabled }}
{{- $sm := .Values.serviceMonitor }}
{{- $interval := include "kvplane.durationMs" $sm.interval | int64 }}
{{- $timeout := include "kvplane.durationMs" $sm.scrapeTimeout | int64 }}
{{- if eq $interval 0 }}
{{- fail (printf "serviceMonitor.interval: %q is zero (allowed: a duration above 0, e.g. 30s)" $sm.interval) }}
{{- end }}
{{- if eq $timeout 0 }}
{{- fail (printf "serviceMonitor.scrapeTimeout: %q is zero (allowed: a duration above 0, at most serviceMonitor.interval)" $sm.scrapeTimeout) }}
{{- end }}
{{- if gt $timeout $interval }}
{{- fail (printf "serviceMonitor.scrapeTimeout: %q is longer than serviceMonitor.interval = %q (Prometheus refuses such a scrape config and the Operator skips the ServiceMonitor, so nothing is scraped; allowed: scrapeTimeout <= interval)" $sm.scrapeTimeout $sm.interval) }}
{{- end }}
{{- end }}
{{- if gt (addf (float64 .Values.server.graceSeconds) 2.0) (float64 .Values.terminationGracePeriodSeconds) }}
{{- fail (printf "server.graceSeconds: %v is not 2 s below terminationGracePeriodSeconds = %v (the server notices SIGTERM within 1 s, then drains for graceSeconds: the pod would be killed mid-drain)" .Values.server.graceSeconds .Values.terminationGracePeriodSeconds) }}
{{- end }}
{{- if and .Values.service.externalTrafficPolicy (eq .Values.service.type "ClusterIP") }}
{{- fail (printf "service.externalTrafficPolicy: %q applies to NodePort and LoadBalancer Services only (service.type is ClusterIP; Kubernetes rejects it there)" .Values.service.externalTrafficPolicy) }}
{{- end }}
{{- if eq (int64 .Values.service.grpcPort) (int64 .Values.service.metricsPort) }}
{{- fail (printf "service.metricsPort: %d equals service.grpcPort (allowed: two different ports)" (int64 .Values.service.metricsPort)) }}
{{- end }}
{{- if (has (int64 .Values.service.healthPort) (list (include "kvplane.grpcContainerPort" . | int64) (include "kvplane.metricsContainerPort" . | int64))) }}
{{- fail (printf "service.healthPort: %d equals the container's gRPC port (%s) or metrics port (%s) (allowed: any other port in [1024, 65535])" (int64 .Values.service.healthPort) (include "kvplane.grpcContainerPort" .) (include "kvplane.metricsContainerPort" .)) }}
{{- end }}
{{- end }}
