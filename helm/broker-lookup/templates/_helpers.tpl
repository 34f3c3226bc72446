{{/*
Chart name, truncated to the 63-character DNS label limit.
*/}}
{{- define "broker-lookup.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name (release + chart unless the release name already holds
the chart name). Truncated to 40 so that "-worker-headless" fits 63 and StatefulSet names stay
under 52 (pod names add "-<ordinal>", revision labels add a hash).
*/}}
{{- define "broker-lookup.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "broker-lookup.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Standard labels on every object.
*/}}
{{- define "broker-lookup.labels" -}}
helm.sh/chart: {{ include "broker-lookup.chart" . }}
{{ include "broker-lookup.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: broker-lookup
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels: only immutable ones (name + instance; component is added per workload).
*/}}
{{- define "broker-lookup.selectorLabels" -}}
app.kubernetes.io/name: {{ include "broker-lookup.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "broker-lookup.workerSelectorLabels" -}}
{{ include "broker-lookup.selectorLabels" . }}
app.kubernetes.io/component: worker
{{- end }}

{{- define "broker-lookup.redisSelectorLabels" -}}
{{ include "broker-lookup.selectorLabels" . }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "broker-lookup.workerFullname" -}}
{{- printf "%s-worker" (include "broker-lookup.fullname" .) }}
{{- end }}

{{- define "broker-lookup.redisFullname" -}}
{{- printf "%s-redis" (include "broker-lookup.fullname" .) }}
{{- end }}

{{- define "broker-lookup.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "broker-lookup.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
image reference: repository@digest when a digest is set, else repository:tag.
Call with (dict "image" .Values.image "default" .Chart.AppVersion "key" "image").
*/}}
{{- define "broker-lookup.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- $tag := default .default .image.tag | toString }}
{{- if not $tag }}
{{- fail (printf "%s: set tag or digest" .key) }}
{{- end }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{/*
Name and key of the Secret holding the Redis password.
*/}}
{{- define "broker-lookup.secretName" -}}
{{- if .Values.auth.existingSecret }}
{{- tpl .Values.auth.existingSecret . }}
{{- else }}
{{- printf "%s-redis-auth" (include "broker-lookup.fullname" .) }}
{{- end }}
{{- end }}

{{- define "broker-lookup.secretPasswordKey" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecretPasswordKey }}
{{- else }}
{{- print "redis-password" }}
{{- end }}
{{- end }}

{{/*
Redis URL the workers and the test hook use (never contains the password).
*/}}
{{- define "broker-lookup.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/0" (include "broker-lookup.redisFullname" .) (int .Values.redis.port) }}
{{- else }}
{{- .Values.externalRedis.url }}
{{- end }}
{{- end }}

{{/*
In-cluster DNS name of the bundled Redis Service.
*/}}
{{- define "broker-lookup.redisHost" -}}
{{- printf "%s.%s.svc" (include "broker-lookup.redisFullname" .) .Release.Namespace }}
{{- end }}

{{/*
Fail early on combinations that cannot work.
*/}}
{{- define "broker-lookup.validate" -}}
{{- if and (not .Values.redis.enabled) (not .Values.externalRedis.url) }}
{{- fail "redis.enabled=false needs externalRedis.url (e.g. redis://redis.cache.svc:6379/0)" }}
{{- end }}
{{- if and .Values.redis.enabled .Values.externalRedis.url }}
{{- fail "set either redis.enabled=true or externalRedis.url, not both" }}
{{- end }}
{{- if regexMatch "^rediss?://[^/@]*:[^/@]*@" .Values.externalRedis.url }}
{{- fail "externalRedis.url must not contain a password: put it in auth.existingSecret (key auth.existingSecretPasswordKey)" }}
{{- end }}
{{- if and .Values.auth.enabled (not .Values.redis.enabled) (not .Values.auth.existingSecret) (not .Values.auth.password) }}
{{- fail "external Redis with auth.enabled=true needs auth.existingSecret (or auth.password); a generated password would not match the server" }}
{{- end }}
{{- if and .Values.pdb.enabled (not (kindIs "invalid" .Values.pdb.minAvailable)) (not (kindIs "invalid" .Values.pdb.maxUnavailable)) }}
{{- fail "pdb: set only one of minAvailable and maxUnavailable (set the other to null)" }}
{{- end }}
{{- end }}

{{/*
The environment shared by the worker container and the test hook.
*/}}
{{- define "broker-lookup.redisEnv" -}}
- name: BROKER_LOOKUP_REDIS_URL
  value: {{ include "broker-lookup.redisUrl" . | quote }}
{{- if .Values.auth.enabled }}
- name: BROKER_LOOKUP_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "broker-lookup.secretName" . }}
      key: {{ include "broker-lookup.secretPasswordKey" . }}
{{- end }}
- name: BROKER_LOOKUP_ENGINE_ID
  value: {{ .Values.engine.id | quote }}
- name: BROKER_LOOKUP_WORLD_SIZE
  value: {{ .Values.engine.worldSize | quote }}
{{- end }}

{{/*
Worker config file content (null fields are left to the worker's defaults).
*/}}
{{- define "broker-lookup.workerConfig" -}}
{{- $cfg := dict }}
{{- range $k, $v := .Values.worker.extraConfig }}
{{- if hasKey $.Values.worker.config $k }}
{{- fail (printf "worker.extraConfig.%s: set it as worker.config.%s instead" $k $k) }}
{{- end }}
{{- end }}
{{- range $k, $v := merge (deepCopy .Values.worker.config) .Values.worker.extraConfig }}
{{- if not (kindIs "invalid" $v) }}
{{- $_ := set $cfg $k $v }}
{{- end }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
"true" when the ServiceMonitor renders: enabled, and the CRD's API is served
(or serviceMonitor.force, for helm template and tests). Empty otherwise.
*/}}
{{- define "broker-lookup.serviceMonitorEnabled" -}}
{{- if and .Values.serviceMonitor.enabled (or .Values.serviceMonitor.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) }}
{{- print "true" }}
{{- end }}
{{- end }}
